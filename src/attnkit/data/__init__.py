"""Text in, token ids out; knows no task.

========================  ==========================================================================
module                    what it holds
========================  ==========================================================================
``readers``               lines and parallel text, streamed; errors name ``file:line``
``labelled``              labelled ``.tsv`` / ``.csv`` files (text and label columns)
``documents``             long documents: ``<br />`` tags, truncation, held-out rows
``dates``                 the built-in dates task (generated, no download)
``tokenizer``             the :class:`~attnkit.data.tokenizer.Tokenizer` of every run, its kinds and the special ids
``pieces``                one piece model per kind: SentencePiece (trained here), SentencePiece + a
                          vocabulary (Marian), WordPiece (BERT, the ``tokenizers`` library)
``spm_train``             training a SentencePiece model on streamed text
``hf_tokenizer``          writing the imported kinds (``attnkit import``)
``tokenizers_json``       kind ``hf-tokenizers``: an imported causal LM's ``tokenizer.json``, renumbered
``chat_template``         a conversation as an instruct model's text: its Jinja chat template, rendered as
                          transformers renders it, and the pieces that end a turn
``batching``              length filters and token-budget batches
``arrays``                token sequences stored flat, written once and memory-mapped
``prepare``               prepared corpora: a task's :class:`~attnkit.data.prepare.Recipe`, encoded
                          in several processes into memory-mapped arrays with a manifest
========================  ==========================================================================
"""
