"""The run directory, the contract between ``attnkit train`` and every other command: ``layout`` (every file
name, finding weights and checkpoints), ``directory`` (writing it: config, atomic checkpoints, metrics),
``checkpoint`` (safetensors weights, the trainer state loaded with ``weights_only=True``) and ``load``
(the one model factory, loading a run, and the one check that a command got the kind of run it needs)."""
