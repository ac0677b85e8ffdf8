"""JSON extraction with a schema: the output is valid JSON for the schema (needs a server with
constraints; a server without them fails the step with a clear error)."""

import json

from _common import setup

from splitserve import lang

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "city": {"type": "string"},
                   "age": {"type": "integer"}},
    "required": ["name", "city", "age"],
}


@lang.function
def extract(s, text: str):
    s += lang.user(f"Extract the person as JSON (name, city, age):\n{text}")
    s += lang.assistant(lang.gen("person", json_schema=SCHEMA, max_tokens=64))


if __name__ == "__main__":
    setup(__doc__)
    s = extract.run("Maria, 34, moved from Lisbon to Berlin last year.", temperature=0)
    print(json.loads(s["person"]))
