"""Constraint planning: what a request's constraint asks of the grammar backends, decided before
anything compiles, with no torch and no engine.

- ``schema_limits``: each backend's measured JSON Schema keyword limits (enforced, refused,
  ignored), by feature.
- ``schema_rewrite``: exact rewrites of a schema into keywords more backends enforce.
- ``chain``: the backend chain for one constraint (the first backend that enforces all of it;
  ``strict`` keeps only those).

The API server plans with it to refuse a ``strict`` schema no backend enforces (a 400 naming
each keyword) and to name what a best-effort one leaves unenforced; the engine's grammar service
(``engine.grammar.service``) walks the same plan when it compiles. It imports only the standard
library and ``jsonschema``.
"""
