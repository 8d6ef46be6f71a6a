"""The allow-list of a run whose shapes change along the schedule (dynamic expert expansion,
``retention.expand-experts``: ``coordinator/expand.py``): ``merge_policies`` folds one ``build_policy`` per expert
count into the one policy the run signs at ``run-start``. A field whose shape differs between the stages is listed
under ``shape_choices`` (its shape must be one of them: ``server_guard.check_against_policy`` and the audit check
it); every other rule is as ``build_policy`` writes it.

Must not: read party data, or loosen anything beyond the stages it is given (one policy is returned as it is).
"""

from __future__ import annotations


def merge_policies(policies: list[dict]) -> dict:
    """One allow-list for a run whose shapes change along the schedule (dynamic expert expansion: one policy per
    expert count, ``coordinator/expand.stages``): per payload type the union of the keys, the intersection of the
    required keys, the largest byte budget, the shapes every stage agrees on in ``shapes`` and, for the others, the
    list of each stage's shape in ``shape_choices`` (a field's shape must be one of them). One policy is itself."""
    if len(policies) == 1:
        return policies[0]
    out: dict = {}
    for tag in sorted(set().union(*policies)):
        ents = [p[tag] for p in policies if tag in p]
        ent = {**ents[0], "keys": sorted(set().union(*[e["keys"] for e in ents])),
               "required": sorted(set.intersection(*[set(e["required"]) for e in ents])),
               "max_bytes": max(e["max_bytes"] for e in ents)}
        fields = set().union(*[e["shapes"] for e in ents])
        shapes, choices = {}, {}
        for k in sorted(fields):
            seen = []
            for e in ents:
                if k in e["shapes"] and list(e["shapes"][k]) not in seen:
                    seen.append(list(e["shapes"][k]))
            if len(seen) == 1:
                shapes[k] = seen[0]
            else:
                choices[k] = seen
        ent["shapes"] = shapes
        if choices:
            ent["shape_choices"] = choices
        out[tag] = ent
    return out
