"""Expert placement policy: which logical expert each physical slot holds.

`rebalance_experts` is a pure function of (load, slot/rank/node shape, current placement).
Per layer it:

1. gives the redundant slots to the experts with the largest load per replica (hot experts
   get replicas), never more replicas than ranks so replicas can sit on different ranks;
2. packs replicas onto ranks, heaviest first onto the least-loaded rank that does not hold that
   expert yet, then improves the most-loaded rank by pairwise swaps;
3. when there are several nodes, first places whole experts (or expert groups) on nodes and
   replicates them inside their node, so a replica copy never crosses nodes and a
   group-limited router touches few nodes; it falls back to flat placement if that would cost
   more than `_NODE_SLACK` of balance;
4. against `current`, also tries plans that keep what is already in place, relabels ranks of a
   fresh plan to overlap the current one, and keeps each expert in its current slot within a
   rank. Among the plans whose most-loaded rank is within `slack` of the fresh plan's, the one
   that moves fewest experts wins.

The fresh plan depends only on the load, so the choice is stable: calling again with the same
load and the returned placement as `current` moves nothing.
"""

from __future__ import annotations

import heapq
from collections import Counter

import torch

_EPS = 1e-9  # relative float tolerance when comparing rank loads
_NODE_SLACK = 0.05  # hierarchical placement may cost this much balance before we go flat
_MAX_SWAPS = 256  # per scope; swaps strictly improve, this only bounds pathological inputs

Plan = dict  # rank -> list of logical experts; counts kept alongside as dict expert -> replicas


def rebalance_experts(
    load,
    num_physical: int,
    num_ranks: int,
    num_nodes: int = 1,
    current=None,
    *,
    num_groups: int | None = None,
    slack: float = 0.0,
) -> torch.Tensor:
    """Return phy2log `[layers, num_physical]` (long) for `load` `[layers, logical_experts]`.

    Rank r owns slots r*P//R .. (r+1)*P//R; node n owns ranks n*R//N .. (n+1)*R//N.
    `num_groups` (optional) keeps expert groups (consecutive ids, as in group-limited routing)
    on one node. `slack` lets a plan be that much more imbalanced if it moves fewer experts.
    """
    load = torch.as_tensor(load, dtype=torch.float64)
    if load.dim() == 1:
        load = load.unsqueeze(0)
    if load.dim() != 2:
        raise ValueError(f"load must be [layers, experts], got shape {tuple(load.shape)}")
    layers, experts = load.shape
    P, R, N = int(num_physical), int(num_ranks), int(num_nodes)
    if experts < 1 or R < 1 or N < 1:
        raise ValueError("need at least one expert, rank and node")
    if P < experts:
        raise ValueError(f"num_physical={P} < logical experts={experts}")
    if R % N:
        raise ValueError(f"num_ranks={R} not divisible by num_nodes={N}")
    if (load < 0).any() or not torch.isfinite(load).all():
        raise ValueError("load must be finite and non-negative")
    cur = None
    if current is not None:
        cur = torch.as_tensor(current, dtype=torch.long)
        if tuple(cur.shape) != (layers, P):
            raise ValueError(f"current must be [{layers}, {P}], got {tuple(cur.shape)}")
        if cur.numel() and (cur.min() < 0 or cur.max() >= experts):
            raise ValueError("current holds an expert id out of range")
    starts = [r * P // R for r in range(R + 1)]
    caps = [starts[r + 1] - starts[r] for r in range(R)]
    out = torch.empty(layers, P, dtype=torch.long)
    for layer in range(layers):
        w = load[layer].tolist()
        cur_slots = cur[layer].tolist() if cur is not None else None
        cur_ranks = None
        if cur_slots is not None:
            cur_ranks = {r: cur_slots[starts[r] : starts[r + 1]] for r in range(R)}
        plan = _plan_layer(w, caps, N, cur_ranks, num_groups, slack)
        out[layer] = torch.tensor(_to_slots(plan, cur_ranks, starts, R), dtype=torch.long)
    return out


# ---------------------------------------------------------------- one layer


def _plan_layer(w, caps, N, cur_ranks, num_groups, slack):
    E, R = len(w), len(caps)
    flat_ref, flat = _plan_scopes(w, caps, [(list(range(E)), list(range(R)))], cur_ranks, slack)
    parts = _node_partitions(w, caps, N, cur_ranks, num_groups) if N > 1 else []
    if not parts:
        return flat
    node_ranks = [list(range(n * R // N, (n + 1) * R // N)) for n in range(N)]
    # The fresh partition with fresh packings depends on load only: it is the reference, and
    # flat vs hierarchical is decided on it, so repeated calls make the same choice.
    hier_ref, first = _plan_scopes(w, caps, list(zip(parts[0], node_ranks)), cur_ranks, slack)
    if _max_load(hier_ref, w) > _max_load(flat_ref, w) * (1 + _NODE_SLACK) * (1 + _EPS) + _EPS:
        return flat
    limit = _max_load(hier_ref, w) * (1 + slack)
    cands = [hier_ref, first]
    for part in parts[1:]:
        cands.append(_plan_scopes(w, caps, list(zip(part, node_ranks)), cur_ranks, slack, limit)[1])
    return _pick(cands, limit, w, cur_ranks)


def _plan_scopes(w, caps, scopes, cur_ranks, slack, limit=None):
    """Plan each (experts, ranks) scope on its own; return (fresh reference, chosen), merged.

    Every scope is held to the same `limit` on its most-loaded rank (default: the reference's,
    plus slack), so a lightly loaded node may keep more of its current placement.
    """
    fresh = []
    for experts, ranks in scopes:
        budget = sum(caps[r] for r in ranks)
        live = sum(1 for r in ranks if caps[r] > 0)
        counts = _replica_counts(w, experts, budget, live)
        plan = _pack(w, counts, ranks, caps, keep=None)
        _improve(w, plan, target=None)
        fresh.append((plan, budget, live))
    ref = _merge([f[0] for f in fresh])
    if limit is None:
        limit = _max_load(ref, w) * (1 + slack)
    if cur_ranks is None:
        return ref, ref
    chosen = []
    for (experts, ranks), (plan, budget, live) in zip(scopes, fresh):
        counts = plan[1]
        cands = [
            plan,
            _relabel(plan, ranks, caps, cur_ranks),
            _sticky(w, counts, ranks, caps, cur_ranks, limit),
        ]
        in_place = Counter(e for r in ranks for e in cur_ranks[r])
        cur_counts = {e: in_place.get(e, 0) for e in experts}
        # The counts in force are a candidate too: changing a count always costs a move.
        if cur_counts != counts and _valid_counts(cur_counts, budget, live):
            cands.append(_sticky(w, cur_counts, ranks, caps, cur_ranks, limit))
        chosen.append(_pick(cands, limit, w, cur_ranks))
    return ref, _merge(chosen)


def _merge(plans):
    lists, cnt = {}, {}
    for pl, c in plans:
        lists.update(pl)
        cnt.update(c)
    return lists, cnt


def _pick(cands, limit, w, cur_ranks):
    """Fewest moves among plans whose most-loaded rank is within `limit`; else the best one."""
    limit = limit * (1 + _EPS) + _EPS
    keyed = []
    for plan in cands:
        m = _max_load(plan, w)
        keyed.append(((0, _moves(plan[0], cur_ranks), m) if m <= limit else (1, m, 0), plan))
    return min(keyed, key=lambda kp: kp[0])[1]


# ---------------------------------------------------------------- replica counts


def _replica_counts(w, experts, budget, live_ranks):
    """Each extra slot goes to the expert with the largest load per replica."""
    n = len(experts)
    if budget < n:
        raise ValueError(f"{budget} slots cannot hold {n} experts")
    # More replicas than ranks would force two onto one rank; allow it only if unavoidable.
    cap = live_ranks if live_ranks * n >= budget else budget
    cnt = {e: 1 for e in experts}
    heap = [(-w[e], e) for e in experts if cap > 1]
    heapq.heapify(heap)
    for _ in range(budget - n):
        _, e = heapq.heappop(heap)
        cnt[e] += 1
        if cnt[e] < cap:
            heapq.heappush(heap, (-w[e] / cnt[e], e))
    return cnt


def _valid_counts(cnt, budget, live_ranks):
    if sum(cnt.values()) != budget or min(cnt.values()) < 1:
        return False
    return live_ranks * len(cnt) < budget or max(cnt.values()) <= live_ranks


# ---------------------------------------------------------------- packing


def _pack(w, counts, ranks, caps, keep):
    """Longest-processing-time packing of the replicas not already in `keep`."""
    lists = {r: list(keep[r]) if keep else [] for r in ranks}
    load = {r: sum(w[e] / counts[e] for e in lists[r]) for r in ranks}
    held = Counter(e for r in ranks for e in lists[r])
    items = []
    for e in sorted(counts):
        items += [e] * (counts[e] - held.get(e, 0))
    items.sort(key=lambda e: (-w[e] / counts[e], e))
    for e in items:
        room = [r for r in ranks if len(lists[r]) < caps[r]]
        # Prefer a rank without this expert (distinct ranks), then the least loaded.
        r = min(room, key=lambda r: (e in lists[r], load[r], r))
        lists[r].append(e)
        load[r] += w[e] / counts[e]
    _split_duplicates(w, counts, lists)
    return lists, dict(counts)


def _split_duplicates(w, counts, lists):
    """Greedy packing can end with only a rank that already holds the expert left with room;
    swap such a replica with one of similar weight elsewhere so replicas sit on distinct ranks."""
    wt = {e: w[e] / counts[e] for e in counts}
    for a in lists:
        i = 0
        while i < len(lists[a]):
            x = lists[a][i]
            if lists[a].count(x) < 2:
                i += 1
                continue
            best = None
            for b in lists:
                if b == a or x in lists[b]:
                    continue
                for j, y in enumerate(lists[b]):
                    if y not in lists[a]:
                        d = abs(wt[x] - wt[y])
                        if best is None or d < best[0]:
                            best = (d, b, j)
            if best is None:  # unavoidable: more slots on this rank than distinct experts left
                i += 1
                continue
            _, b, j = best
            lists[a][i], lists[b][j] = lists[b][j], x


def _sticky(w, counts, ranks, caps, cur_ranks, target):
    """Keep current replicas the counts still want (one per rank), pack the rest, then swap."""
    left = dict(counts)
    keep = {r: [] for r in ranks}
    for r in ranks:
        for e in cur_ranks[r]:
            if left.get(e, 0) > 0 and e not in keep[r] and len(keep[r]) < caps[r]:
                keep[r].append(e)
                left[e] -= 1
    plan = _pack(w, counts, ranks, caps, keep)
    _improve(w, plan, target)
    return plan


def _improve(w, plan, target):
    """Swap replicas between the most-loaded rank and another until it stops helping.

    Each swap strictly lowers the sorted load vector, so this terminates; `target` stops early
    once the most-loaded rank is good enough, keeping moves few.
    """
    lists, cnt = plan
    wt = {e: w[e] / cnt[e] for e in cnt}
    load = {r: sum(wt[e] for e in lists[r]) for r in lists}
    for _ in range(_MAX_SWAPS):
        hi = max(lists, key=lambda r: (load[r], -r))
        if target is not None and load[hi] <= target * (1 + _EPS) + _EPS:
            return
        best, best_val = None, load[hi] - _EPS * (1 + load[hi])
        hi_set = set(lists[hi])
        for i, x in enumerate(lists[hi]):
            for r in lists:
                if r == hi or x in lists[r]:
                    continue
                for j, y in enumerate(lists[r]):
                    if wt[y] >= wt[x] or y in hi_set:
                        continue
                    val = max(load[hi] - wt[x] + wt[y], load[r] - wt[y] + wt[x])
                    if val < best_val:
                        best, best_val = (i, r, j), val
        if best is None:
            return
        i, r, j = best
        x, y = lists[hi][i], lists[r][j]
        lists[hi][i], lists[r][j] = y, x
        load[hi] += wt[y] - wt[x]
        load[r] += wt[x] - wt[y]


def _relabel(plan, ranks, caps, cur_ranks):
    """Rename ranks of equal capacity so the plan overlaps the current placement most."""
    lists, cnt = plan
    overlap = []
    for a in ranks:
        ca = Counter(lists[a])
        for b in ranks:
            if caps[a] == caps[b]:
                o = sum((ca & Counter(cur_ranks[b])).values())
                overlap.append((-o, a, b))
    overlap.sort()
    new, used_a, used_b = {}, set(), set()
    for _, a, b in overlap:  # greedy matching: good enough, and deterministic
        if a not in used_a and b not in used_b:
            new[b] = list(lists[a])
            used_a.add(a), used_b.add(b)
    return new, dict(cnt)


# ---------------------------------------------------------------- nodes


def _node_partitions(w, caps, N, cur_ranks, num_groups):
    """Candidate assignments of expert units to nodes: fresh first, then the current one."""
    E, R = len(w), len(caps)
    G = num_groups or E
    if E % G or G % N:
        return []
    size = G // N * (E // G)  # experts per node
    node_slots = [sum(caps[n * R // N : (n + 1) * R // N]) for n in range(N)]
    if min(node_slots) < size:
        return []
    unit = [list(range(u * (E // G), (u + 1) * (E // G))) for u in range(G)]
    uload = [sum(w[e] for e in unit[u]) for u in range(G)]
    per_node = G // N

    def lpt(order, start):
        nodes = [list(x) for x in start]
        nl = [sum(uload[u] for u in nodes[n]) for n in range(N)]
        for u in order:
            n = min(
                (n for n in range(N) if len(nodes[n]) < per_node), key=lambda n: (nl[n] / node_slots[n], n)
            )
            nodes[n].append(u)
            nl[n] += uload[u]
        return nodes

    by_load = sorted(range(G), key=lambda u: (-uload[u], u))
    parts = [lpt(by_load, [[] for _ in range(N)])]
    if cur_ranks is not None:
        # Home node of a unit: the node holding most of its current replicas.
        votes = [[0] * N for _ in range(G)]
        for r in range(R):
            for e in cur_ranks[r]:
                votes[e // (E // G)][r * N // R] += 1
        home = [[] for _ in range(N)]
        for u in by_load:  # heavy units keep their home first
            n = max(range(N), key=lambda n: (votes[u][n], -n))
            if len(home[n]) < per_node:
                home[n].append(u)
        placed = {u for h in home for u in h}
        sticky = lpt([u for u in by_load if u not in placed], home)
        # Swap units between nodes until node loads are as even as the fresh partition's.
        plan = ({n: sticky[n] for n in range(N)}, {u: 1 for u in range(G)})
        _improve(uload, plan, target=max(sum(uload[u] for u in p) for p in parts[0]))
        parts.append([plan[0][n] for n in range(N)])
    return [[[e for u in part[n] for e in unit[u]] for n in range(N)] for part in parts]


# ---------------------------------------------------------------- helpers


def _max_load(plan, w):
    lists, cnt = plan
    return max((sum(w[e] / cnt[e] for e in lst) for lst in lists.values()), default=0.0)


def _moves(lists, cur_ranks):
    """Replicas a rank must load that it does not hold now."""
    if cur_ranks is None:
        return 0
    return sum(sum((Counter(lst) - Counter(cur_ranks[r])).values()) for r, lst in lists.items())


def _to_slots(plan, cur_ranks, starts, R):
    """Lay each rank's experts into its slots, leaving experts already in a slot where they are."""
    lists, _ = plan
    out = []
    for r in range(R):
        want = Counter(lists[r])
        slots = [None] * (starts[r + 1] - starts[r])
        if cur_ranks is not None:
            for i, e in enumerate(cur_ranks[r]):
                if want[e] > 0:
                    slots[i] = e
                    want[e] -= 1
        rest = sorted(want.elements())
        out += [e if e is not None else rest.pop(0) for e in slots]
    return out
