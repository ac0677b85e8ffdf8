"""Tool calls: the envelope each model family writes (``formats``), the built-in tool prompt
(``prompt``), the grammar that enforces the calls (``grammar``), a request's tool fields checked
together (``request``), and the parser from model text to OpenAI ``tool_calls`` (``extract``,
``calls``, ``stream``)."""
