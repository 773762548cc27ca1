"""Why one policy's engine hits differ from another's: the gateway's decisions, request by request.

`kvmesh bench engines --decisions DIR` keeps every request's decision record
(`kvmesh.gateway.decisions.DecisionRecord` with the turn's index,
conversation, round and TTFT). Here they are summed per policy and two
policies are compared on the same turns, each loss of blocks put in one of
these classes, first that applies:

- ``away``: the router counted more blocks held on another engine than on
  the one it chose (load, or a tie break, sent the request away from its
  prefix);
- ``overestimated``: the chosen engine held fewer blocks than the router
  counted (evicted meanwhile, or a prefilling prompt that did not cache);
- ``unseen``: the chosen engine held more than the router counted (its
  events had not arrived: the router's view lagged);
- ``nowhere``: the router's view was right and no engine held more: the
  prefix was not cached where this policy's earlier decisions put things.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

Record = Mapping[str, Any]

LOSS_CLASSES = ("away", "overestimated", "unseen", "nowhere")


@dataclass(slots=True)
class PolicyDecisions:
    """One policy's decisions summed (blocks are the engines' KV blocks)."""

    policy: str
    requests: int = 0
    prompt_blocks: int = 0
    predicted_blocks: int = 0
    realized_blocks: int = 0
    unrealized: int = 0  # requests whose engine reported no usage
    overestimated_blocks: int = 0  # predicted beyond realized
    unseen_blocks: int = 0  # realized beyond predicted
    away: int = 0  # requests sent to an engine holding less than another (by the router's view)
    away_blocks: int = 0  # blocks of prefix the router knew elsewhere on those
    follow_ups: int = 0
    stayed: int = 0  # follow-ups on the engine of the conversation's previous turn

    @property
    def hit_ratio(self) -> float:
        return self.realized_blocks / self.prompt_blocks if self.prompt_blocks else 0.0

    @property
    def stay_ratio(self) -> float:
        return self.stayed / self.follow_ups if self.follow_ups else 0.0


def summarize(policy: str, records: Iterable[Record]) -> PolicyDecisions:
    """`records` of one policy, any rounds; one pass after sorting by (round, turn)."""
    out = PolicyDecisions(policy)
    previous: dict[tuple[int, int], str] = {}
    for r in sorted(records, key=lambda r: (r["round"], r["turn"])):
        out.requests += 1
        out.prompt_blocks += r["prompt_blocks"]
        predicted = predicted_total(r)
        out.predicted_blocks += predicted
        realized = r["realized_blocks"]
        if realized is None:
            out.unrealized += 1
        else:
            out.realized_blocks += realized
            out.overestimated_blocks += max(0, predicted - realized)
            out.unseen_blocks += max(0, realized - predicted)
        best = max(r["overlaps"].values(), default=0)
        if best > r["overlaps"].get(r["engine"], 0):
            out.away += 1
            out.away_blocks += best - r["overlaps"].get(r["engine"], 0)
        key = (r["round"], r["conversation"])
        if key in previous:
            out.follow_ups += 1
            out.stayed += previous[key] == r["engine"]
        previous[key] = r["engine"]
    return out


def predicted_total(r: Record) -> int:
    """Blocks the router expected the engine not to compute: its own cache's and, under
    ``kv_mesh``, those it loads from its store and pulls (records before these: own only)."""
    return int(r.get("predicted_total", r["predicted_blocks"]))


def loss_class(r: Record) -> str:
    """Why `r` realized fewer blocks than it might have (see the module docstring)."""
    mine = r["overlaps"].get(r["engine"], 0)
    if max(r["overlaps"].values(), default=0) > mine:
        return "away"
    realized = r["realized_blocks"] or 0
    if realized < predicted_total(r):
        return "overestimated"
    if realized > predicted_total(r):
        return "unseen"
    return "nowhere"


@dataclass(slots=True)
class Comparison:
    """Policy `a` against `b` on the turns both served (same round and turn index)."""

    a: str
    b: str
    turns: int = 0
    a_more: int = 0  # turns where a realized more blocks than b
    b_more: int = 0
    lost: dict[str, int] = field(default_factory=lambda: dict.fromkeys(LOSS_CLASSES, 0))
    """Blocks a realized fewer than b on the turns b did better, by a's loss class."""
    lost_turns: dict[str, int] = field(default_factory=lambda: dict.fromkeys(LOSS_CLASSES, 0))


def compare(a: str, a_records: Iterable[Record], b: str, b_records: Iterable[Record]) -> Comparison:
    """Where `a` realized fewer blocks than `b` on the same turn, and why (`loss_class` of a's)."""
    mine = {(r["round"], r["turn"]): r for r in a_records if r["realized_blocks"] is not None}
    out = Comparison(a, b)
    for r in b_records:
        other = mine.get((r["round"], r["turn"]))
        if other is None or r["realized_blocks"] is None:
            continue
        out.turns += 1
        diff = r["realized_blocks"] - other["realized_blocks"]
        if diff < 0:
            out.a_more += 1
        elif diff > 0:
            out.b_more += 1
            why = loss_class(other)
            out.lost[why] += diff
            out.lost_turns[why] += 1
    return out


def write(path: Path, records: Sequence[Record]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def read(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def report(by_policy: Mapping[str, Sequence[Record]]) -> str:
    """The per-policy table and, against `kv_aware`, each other policy's comparison."""
    lines = [
        f"{'policy':<16} {'req':>5} {'prompt':>7} {'predicted':>9} {'realized':>8} "
        f"{'hit':>6} {'over':>5} {'unseen':>6} {'away':>10} {'stayed':>7}"
    ]
    for policy, records in by_policy.items():
        s = summarize(policy, records)
        lines.append(
            f"{policy:<16} {s.requests:>5} {s.prompt_blocks:>7} {s.predicted_blocks:>9} "
            f"{s.realized_blocks:>8} {s.hit_ratio:>6.3f} {s.overestimated_blocks:>5} "
            f"{s.unseen_blocks:>6} {s.away:>4} ({s.away_blocks:>3}) {s.stay_ratio:>7.2f}"
            + (f"  no usage from {s.unrealized}" if s.unrealized else "")
        )
    base = by_policy.get("kv_aware")
    if base is not None:
        for policy, records in by_policy.items():
            if policy == "kv_aware":
                continue
            c = compare("kv_aware", base, policy, records)
            lost = ", ".join(
                f"{k} {c.lost[k]} blocks/{c.lost_turns[k]} turns" for k in LOSS_CLASSES
            )
            lines.append(
                f"kv_aware vs {policy} on {c.turns} turns: kv_aware more on {c.a_more}, "
                f"{policy} more on {c.b_more}; kv_aware's losses: {lost}"
            )
    return "\n".join(lines)
