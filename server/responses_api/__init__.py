"""``POST /v1/responses`` (OpenAI's Responses API), a thin translator over the chat path.

A Responses request becomes the chat request the chat path already serves (``translate``: items
-> messages, function tools -> ``tools``, ``text.format`` -> ``response_format``), so its job is
the one ``server.job_builder`` builds (chat template, tool grammar, constraint, sampling) and its
tokens come from the same ``server.generation.stream_text``. The same text becomes output items
and, streamed, OpenAI's event sequence (``output``). Around it: the field tables (``fields``,
checked by ``field_check``), the request models (``protocol``), the SQLite store of responses
(``store``), background responses (``background``) and the routes (``routes``).
"""
