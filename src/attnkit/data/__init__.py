"""Text in, token ids out; knows no task.

========================  ==========================================================================
module                    what it holds
========================  ==========================================================================
``readers``               lines and parallel text, streamed; errors name ``file:line``
``labelled``              labelled ``.tsv`` / ``.csv`` files (text and label columns)
``documents``             long documents: ``<br />`` tags, truncation, held-out rows
``dates``                 the built-in dates task (generated, no download)
``tokenizer``             SentencePiece: training, loading, encoding, the special ids
``batching``              length filters and token-budget batches
``arrays``                token sequences stored flat, written once and memory-mapped
``prepare``               prepared corpora: a task's :class:`~attnkit.data.prepare.Recipe`, encoded
                          in several processes into memory-mapped arrays with a manifest
========================  ==========================================================================
"""
