"""Anthropic's Messages API (``POST /v1/messages``, ``POST /v1/messages/count_tokens``) as a thin
translator over the chat path: a request becomes the one internal chat request
(``translate``), whose :class:`~splitserve.server.job.Job` the chat path's ``JobBuilder``
builds (template, tool grammar, constraint, sampling); the job's token stream comes back as
Anthropic content blocks and events (``blocks``, ``answer``). The field table (``fields``),
the request models (``protocol``), Anthropic's error shape (``errors``) and the routes
(``routes``) are the rest. docs/api.md, "Anthropic Messages", is the user's view."""
