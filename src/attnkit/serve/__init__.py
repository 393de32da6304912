"""attnkit.serve: ``attnkit serve``, trained models over HTTP.

======================  ===================================================================================
module                  holds
======================  ===================================================================================
``app.py``              the FastAPI app (:func:`~attnkit.serve.app.create_app`): its routes but ``/generate``
                        (the table of endpoints is there), the API-key and body-size gate, and the uvicorn
                        start-up (:func:`~attnkit.serve.app.listen`, :func:`~attnkit.serve.app.serve`)
``generate_route.py``   ``POST /generate``: a request checked, turned into a generation job, queued, and
                        answered whole or streamed as server-sent events
``openai_routes.py``    the OpenAI-compatible API (``/v1/models``, ``/v1/completions``,
                        ``/v1/chat/completions``): the same jobs, answered in OpenAI's shapes
``openai_schemas.py``   its requests and responses (OpenAI's fields) and OpenAI's error
``flights.py``          a language model's generations from the event loop, for both route families: checked,
                        counted against ``max_streams``, queued, awaited or streamed, cancelled
``routing.py``          what the routes share: the app's state (``AppState``), the model a request names, the
                        size checks, a job on the model's worker, attention joined into a response as bytes
``schemas.py``          the request and response models, and the JSON errors (``{"error": "..."}``)
``servables.py``        what is served: :class:`~attnkit.serve.servables.ModelInfo`, the ``Servable``
                        protocol, a run directory or a CTranslate2 export behind it, ``load_servable``
``batching.py``         one worker thread per model, merging concurrent requests into batches of similar
                        length within a token budget
``generation.py``       a language model's ``/generate`` requests as the worker runs them: continuous
                        batching over :mod:`attnkit.engine.continuous_lm`, each token told to the event
                        loop as it is chosen (streaming), a client gone cancelling its row
``metrics.py``          ``GET /metrics`` (prometheus_client, one registry per app) and the middleware that
                        counts and times every request
``connections.py``      uvicorn's HTTP protocol with bounds: head and target sizes, the time a head may take,
                        the connections open at once
``serve.html``          the page at ``GET /`` (the attention explorer's script and style inlined)
======================  ===================================================================================

Nothing here imports FastAPI, uvicorn or prometheus_client (only ``app.py`` and the modules it imports: the routes,
``flights.py``, ``routing.py``, the schemas and ``connections.py``, load them): the CLI reads the limits' defaults from
:mod:`attnkit.serve.batching` for its ``--help`` without loading them.
"""
