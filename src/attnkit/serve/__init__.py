"""attnkit.serve: ``attnkit serve``, trained models over HTTP.

==================  ===================================================================================
module              holds
==================  ===================================================================================
``app.py``          the FastAPI app (:func:`~attnkit.serve.app.create_app`): its state, its routes (the
                    table of endpoints is there), the API-key and body-size gate, and the uvicorn
                    start-up (:func:`~attnkit.serve.app.listen`, :func:`~attnkit.serve.app.serve`)
``schemas.py``      the request and response models, and the JSON errors (``{"error": "..."}``)
``servables.py``    what is served: :class:`~attnkit.serve.servables.ModelInfo`, the ``Servable``
                    protocol, a run directory or a CTranslate2 export behind it, ``load_servable``
``batching.py``     one worker thread per model, merging concurrent requests into batches of similar
                    length within a token budget
``metrics.py``      ``GET /metrics`` (prometheus_client, one registry per app) and the middleware that
                    counts and times every request
``serve.html``      the page at ``GET /`` (the attention explorer's script and style inlined)
==================  ===================================================================================

Nothing here imports FastAPI or prometheus_client (only ``app.py`` loads ``metrics.py``): the CLI
reads the limits' defaults from :mod:`attnkit.serve.batching` for its ``--help`` without loading them.
"""
