"""The run directory, the contract between ``attnkit train`` and every other command: ``layout`` (every file
name, finding weights and checkpoints), ``directory`` (writing it: config, atomic checkpoints, metrics),
``checkpoint`` (safetensors weights, the trainer state loaded with ``weights_only=True``) and ``load``
(restoring a trained run into the model the factory it is given builds: :func:`attnkit.tasks.load_run` gives its
task's)."""
