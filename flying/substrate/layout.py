"""The rank layout of a node, defined once.

Axis order: engines are numbered 0..N-1 (SGLang's dp_rank). A TP group of degree m is an
aligned, contiguous block of engine ranks ``[g*m, (g+1)*m)``; its leader is its lowest
rank, and a member's rank inside the group is ``dp_rank - g*m`` (the TP rank, which
selects the weight shard and the KV head group). Only aligned blocks are allowed: the
number of groups grows linearly with N, and contiguous ranks share the fastest links.

Pure Python, no torch: used by the controller, the engines and the policy alike.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Group:
    degree: int
    index: int  # g: the group's position among the degree's aligned groups

    @property
    def ranks(self) -> tuple[int, ...]:
        start = self.index * self.degree
        return tuple(range(start, start + self.degree))

    @property
    def leader(self) -> int:
        return self.index * self.degree

    def tp_rank(self, dp_rank: int) -> int:
        if dp_rank not in self.ranks:
            raise ValueError(f"engine {dp_rank} is not in group {self.ranks}")
        return dp_rank - self.leader

    @property
    def name(self) -> str:
        return f"flying_tp{self.degree}_g{self.index}"


def allowed_degrees(num_engines: int, num_kv_heads: int, num_heads: int) -> list[int]:
    """Powers of two in [2, N] that divide both the KV head and attention head counts."""
    out, m = [], 2
    while m <= num_engines:
        if num_engines % m == 0 and num_kv_heads % m == 0 and num_heads % m == 0:
            out.append(m)
        m *= 2
    return out


def validate_degrees(
    requested: list[int], num_engines: int, num_kv_heads: int, num_heads: int
) -> list[int]:
    """Check a user's degree list; raise ValueError naming what is wrong."""
    ok = set(allowed_degrees(num_engines, num_kv_heads, num_heads))
    bad = [m for m in requested if m not in ok]
    if bad:
        raise ValueError(
            f"--flying-tp-degrees {bad} not allowed: degrees must be powers of two that "
            f"divide the engine count ({num_engines}), the KV heads ({num_kv_heads}) and "
            f"the attention heads ({num_heads}); allowed: {sorted(ok) or 'none'}"
        )
    return sorted(set(requested))


def groups_of(degree: int, num_engines: int) -> list[Group]:
    return [Group(degree, g) for g in range(num_engines // degree)]


def group_containing(degree: int, dp_rank: int) -> Group:
    return Group(degree, dp_rank // degree)
