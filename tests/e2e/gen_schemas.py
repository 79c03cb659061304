#!/usr/bin/env python3
"""Random JSON schemas and requests for tests/e2e/structured.sh (deterministic: --seed).

Each schema is an object with 1-5 properties drawn from the kinds quern supports: strings
(plain, enum, bounded length, date / date-time / uuid formats), integers (with and without
bounds), numbers (plain, minimum 0), booleans, nulls, arrays (items of any kind, min/max
items), nested objects, anyOf (often [T, null] as pydantic writes Optional), $ref to $defs,
optional properties and additionalProperties false. Prints one request line per schema
(chat, asking for a record of that shape), then a few json_object lines.

  gen_schemas.py N SEED > requests.jsonl
"""
import json
import random
import sys

WORDS = ["name", "title", "count", "tags", "score", "when", "id", "kind", "items", "owner",
         "price", "active", "notes", "size", "colour", "city", "level", "author", "rating"]


def leaf(r, depth, defs):
    k = r.randrange(12 if depth < 2 else 8)
    if k == 0:
        return {"type": "string"}
    if k == 1:
        return {"type": "string", "enum": r.sample(["red", "green", "blue", "x y", "\u00e9t\u00e9"], r.randint(1, 4))}
    if k == 2:
        lo = r.randint(0, 3)
        return {"type": "string", "minLength": lo, "maxLength": lo + r.randint(1, 12)}
    if k == 3:
        return {"type": "string", "format": r.choice(["date", "date-time", "time", "uuid"])}
    if k == 4:
        s = {"type": "integer"}
        if r.random() < 0.6:
            lo = r.randint(-50, 50)
            s["minimum"] = lo
            s["maximum"] = lo + r.randint(0, 2000)
        return s
    if k == 5:
        return {"type": "number"} if r.random() < 0.5 else {"type": "number", "minimum": 0}
    if k == 6:
        return {"type": "boolean"}
    if k == 7:
        return {"anyOf": [leaf(r, depth + 1, defs), {"type": "null"}]}
    if k == 8:
        s = {"type": "array", "items": leaf(r, depth + 1, defs)}
        if r.random() < 0.7:
            s["minItems"] = r.randint(0, 2)
            s["maxItems"] = s["minItems"] + r.randint(0, 3)
        return s
    if k == 9:
        return obj(r, depth + 1, defs)
    if k == 10:
        name = "D%d" % len(defs)
        defs[name] = obj(r, depth + 1, defs)
        return {"$ref": "#/$defs/" + name}
    return {"type": ["string", "integer"]}


def obj(r, depth, defs):
    n = r.randint(1, 5 if depth == 0 else 3)
    names = r.sample(WORDS, n)
    props = {w: leaf(r, depth, defs) for w in names}
    s = {"type": "object", "properties": props,
         "required": [w for w in names if r.random() < 0.8]}
    if r.random() < 0.7:
        s["additionalProperties"] = False
    if r.random() < 0.3:
        s["description"] = "a record"
    return s


def main():
    n, seed = int(sys.argv[1]), int(sys.argv[2])
    r = random.Random(seed)
    for i in range(n):
        defs = {}
        s = obj(r, 0, defs)
        if defs:
            s["$defs"] = defs
        body = {"messages": [{"role": "user", "content": "Reply with a JSON record about %s." % r.choice(
                    ["a book", "a city", "a cat", "an order", "a song", "a planet"])}],
                "max_tokens": 96, "temperature": r.choice([0, 0.7, 1.0]), "seed": i,
                "response_format": {"type": "json_schema",
                                    "json_schema": {"name": "s%d" % i, "strict": True, "schema": s}}}
        print(json.dumps({"custom_id": "s%d" % i, "method": "POST", "url": "/v1/chat/completions",
                          "body": body}))
    for i in range(max(2, n // 20)):
        print(json.dumps({"custom_id": "o%d" % i, "messages": [{"role": "user", "content":
                          "Give me a JSON object about item %d." % i}], "max_tokens": 64,
                          "temperature": 0.8, "seed": i, "response_format": {"type": "json_object"}}))


if __name__ == "__main__":
    main()
