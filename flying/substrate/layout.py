"""The rank layout of a node, defined once.

Axis order: engines are numbered 0..N-1 (SGLang's dp_rank). A TP group of degree m is an
aligned, contiguous block of engine ranks ``[g*m, (g+1)*m)``; its leader is its lowest
rank, and a member's rank inside the group is ``dp_rank - g*m`` (the TP rank, which
selects the weight shard and the KV head group: ``KvSplit``). Only aligned blocks are allowed: the
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


@dataclass(frozen=True)
class KvSplit:
    """Which KV heads each TP rank of a degree-``degree`` group holds: SGLang's own rule
    for ``QKVParallelLinear`` / ``LlamaAttention`` at ``tp_size = degree``.

    - ``kv_heads % degree == 0``: the heads are split, rank r holds heads
      ``[r*H_kv/m, (r+1)*H_kv/m)`` (``shards == degree``, ``replicas == 1``);
    - ``degree % kv_heads == 0`` (fewer KV heads than ranks): every head is *replicated*
      on ``replicas = degree / kv_heads`` consecutive ranks, rank r holds the one head
      ``r // replicas`` (``shards == kv_heads``).

    Query heads are always split (``[r*H_q/m, (r+1)*H_q/m)``): with ``H_q % m == 0`` every
    query head of rank r belongs to GQA group ``r // replicas``, so each rank's queries
    attend to exactly the KV head it holds. ``shards`` is also the number of tokens one
    DP KV slot holds in the group's KV view (``kv_adaptor``): a slot has room for
    ``H_kv`` heads of one token, a rank stores ``heads_per_rank`` per token.
    """

    kv_heads: int
    degree: int

    def __post_init__(self) -> None:
        if self.kv_heads < 1 or self.degree < 1 or (
            self.kv_heads % self.degree and self.degree % self.kv_heads
        ):
            raise ValueError(
                f"{self.kv_heads} KV heads can neither be split nor replicated over TP "
                f"degree {self.degree}: one must divide the other"
            )

    @property
    def shards(self) -> int:
        """Distinct head groups (= tokens per DP slot in the group's KV view)."""
        return min(self.kv_heads, self.degree)

    @property
    def replicas(self) -> int:
        """Ranks holding each head group (1: split, no replication)."""
        return self.degree // self.shards

    @property
    def heads_per_rank(self) -> int:
        return self.kv_heads // self.shards

    def shard(self, rank: int) -> int:
        """The head group TP rank ``rank`` holds."""
        if not 0 <= rank < self.degree:
            raise ValueError(f"TP rank {rank} outside degree {self.degree}")
        return rank // self.replicas

    def heads(self, rank: int) -> range:
        """The KV heads TP rank ``rank`` holds."""
        start = self.shard(rank) * self.heads_per_rank
        return range(start, start + self.heads_per_rank)

    def ranks(self, shard: int) -> range:
        """The TP ranks holding head group ``shard``."""
        return range(shard * self.replicas, (shard + 1) * self.replicas)


def degree_fits(degree: int, num_kv_heads: int, num_heads: int) -> bool:
    """Whether a TP-``degree`` group can run a model of these head counts: the query
    heads split evenly, and the KV heads split evenly or each replicated on the same
    number of ranks (``KvSplit``)."""
    return (
        degree >= 1 and num_heads % degree == 0 and num_kv_heads >= 1
        and (num_kv_heads % degree == 0 or degree % num_kv_heads == 0)
    )


def allowed_degrees(num_engines: int, num_kv_heads: int, num_heads: int) -> list[int]:
    """Powers of two in [2, N] that divide N and the attention head count, and whose KV
    heads split or replicate evenly (``degree_fits``)."""
    out, m = [], 2
    while m <= num_engines:
        if num_engines % m == 0 and degree_fits(m, num_kv_heads, num_heads):
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
            f"divide the engine count ({num_engines}) and the attention heads ({num_heads}), "
            f"and either divide the KV heads ({num_kv_heads}) or be a multiple of them "
            f"(heads replicated); allowed: {sorted(ok) or 'none'}"
        )
    return sorted(set(requested))


def groups_of(degree: int, num_engines: int) -> list[Group]:
    return [Group(degree, g) for g in range(num_engines // degree)]


def group_containing(degree: int, dp_rank: int) -> Group:
    return Group(degree, dp_rank // degree)
