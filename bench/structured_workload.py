"""The structured-output workload the benchmarks share: a mid-sized JSON schema (nested
objects, arrays, enums, required fields) and valid instances of it."""

from __future__ import annotations

MID_SCHEMA: dict = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"type": "string", "enum": ["admin", "editor", "viewer"]},
        "active": {"type": "boolean"},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string", "maxLength": 40},
                "city": {"type": "string", "maxLength": 30},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                 "maxItems": 4},
        "scores": {"type": "array", "items": {"type": "number"}, "maxItems": 4},
    },
    "required": ["name", "age", "role", "address"],
    "additionalProperties": False,
}


def mid_instance(i: int) -> dict:
    """The ``i``-th of a family of different valid instances of ``MID_SCHEMA``."""
    roles = ["admin", "editor", "viewer"]
    return {"name": f"user {i}", "age": 20 + i % 60, "role": roles[i % 3],
            "active": i % 2 == 0,
            "address": {"street": f"{i} Main St", "city": "Springfield", "zip": f"{10000 + i}"},
            "tags": [f"t{j}" for j in range(i % 4)], "scores": [i / 4, 1.5][: i % 3]}
