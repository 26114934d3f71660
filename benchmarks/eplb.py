"""EPLB benchmark: no balancing vs the plain greedy recipe vs pdserve's policy.

Synthetic skewed expert loads (Zipf, a drifting hot set, a coding-heavy phase) are sampled
step by step. Every method starts from the same static placement; greedy and ours rebalance on
the same schedule from the heatmap of the last `period` steps, and "ours+trigger" rebalances
only when the imbalance trigger fires. Each step is scored with the placement in force.
Prints ONE JSON line. Usage: python benchmarks/eplb.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np
import torch

from pdserve.eplb import ImbalanceTrigger, experts_moved, imbalance, rank_load, rebalance_experts
from pdserve.eplb.metrics import slot_ranks


def greedy(load, P, R):
    """The issue's plain recipe: extra slots by load per replica, then longest-first packing."""
    load = torch.as_tensor(load, dtype=torch.float64)
    out = []
    for w in load.tolist():
        E = len(w)
        cnt = [1] * E
        for _ in range(P - E):
            e = max(range(E), key=lambda e: w[e] / cnt[e])
            cnt[e] += 1
        items = sorted((e for e in range(E) for _ in range(cnt[e])), key=lambda e: -w[e] / cnt[e])
        caps = [(r + 1) * P // R - r * P // R for r in range(R)]
        lists, rl = [[] for _ in range(R)], [0.0] * R
        for e in items:
            r = min((r for r in range(R) if len(lists[r]) < caps[r]), key=lambda r: rl[r])
            lists[r].append(e)
            rl[r] += w[e] / cnt[e]
        out.append([e for lst in lists for e in lst])
    return torch.tensor(out, dtype=torch.long)


# ------------------------------------------------------------------ workloads


def zipf_probs(rng, L, E, s):
    p = 1.0 / np.arange(1, E + 1) ** s
    return np.stack([rng.permutation(p / p.sum()) for _ in range(L)])


def scenario(name, rng, L, E, T):
    """Yield per-step expert probabilities `[L, E]`."""
    if name == "zipf":
        p = zipf_probs(rng, L, E, 1.1)
        for _ in range(T):
            yield p
    elif name == "drift":  # a hot set of 8 experts; every 20 steps two of them cool down
        hot = [rng.choice(E, 8, replace=False) for _ in range(L)]
        for t in range(T):
            if t and t % 20 == 0:
                for layer in range(L):
                    cold = np.setdiff1d(np.arange(E), hot[layer])
                    hot[layer][rng.choice(8, 2, replace=False)] = rng.choice(cold, 2, replace=False)
            p = np.ones((L, E))
            for layer in range(L):
                p[layer, hot[layer]] = 8.0
            yield p / p.sum(axis=1, keepdims=True)
    elif name == "coding":  # general text, then a coding-heavy phase, then general again
        base = zipf_probs(rng, L, E, 0.6)
        code = np.stack([rng.choice(E, 6, replace=False) for _ in range(L)])
        heavy = base.copy()
        for layer in range(L):
            heavy[layer, code[layer]] *= 12.0
        heavy /= heavy.sum(axis=1, keepdims=True)
        for t in range(T):
            yield heavy if T // 3 <= t < 2 * T // 3 else base
    else:
        raise ValueError(name)


def sample(rng, probs, choices):
    return np.stack([rng.multinomial(choices, p) for p in probs]).astype(np.float64)


# ------------------------------------------------------------------ simulation


def run(name, seed, L, E, P, R, N, T, period, tokens, topk, slack):
    rng = np.random.default_rng(seed)
    loads = [torch.from_numpy(sample(rng, p, tokens * topk)) for p in scenario(name, rng, L, E, T)]
    static = torch.arange(P).remainder(E).repeat(L, 1)  # experts in order, extras wrap round
    methods = {
        "none": None,
        "greedy": lambda h, cur: greedy(h, P, R),
        "ours": lambda h, cur: rebalance_experts(h, P, R, N, cur),
        f"ours_slack{slack:g}": lambda h, cur: rebalance_experts(h, P, R, N, cur, slack=slack),
        "ours+trigger": lambda h, cur: rebalance_experts(h, P, R, N, cur),
    }
    node_of_slot = slot_ranks(P, R) * N // R
    res = {}
    for m, policy in methods.items():
        place, imb, planned, moves, xnode, secs = static.clone(), [], [], [], 0, 0.0
        trig = ImbalanceTrigger(threshold=1.15, window=4, cooldown=period // 2)
        for t, load in enumerate(loads):
            imb.append(imbalance(rank_load(load, place, R)))
            if policy is None or t + 1 < period:
                continue
            heat = torch.stack(loads[t + 1 - period : t + 1]).sum(0)
            if m == "ours+trigger":
                due = trig.observe(imbalance(rank_load(heat, place, R)))
            else:
                due = (t + 1) % period == 0
            if not due:
                continue
            t0 = time.perf_counter()
            new = policy(heat, place)
            secs += time.perf_counter() - t0
            moves.append(experts_moved(place, new, R) / L)
            planned.append(imbalance(rank_load(heat, new, R)))
            xnode += cross_node_copies(place, new, node_of_slot)
            place = new
        res[m] = {
            "max_mean": round(float(np.mean(imb)), 4),  # realised on the steps that follow
            "planned_max_mean": round(float(np.mean(planned)), 4) if planned else None,
            "rebalances": len(moves),
            "moved_per_rebalance": round(float(np.mean(moves)), 2) if moves else 0.0,
            "moved_total": round(float(np.sum(moves)), 1),
            "cross_node_copies": xnode,
            "policy_s": round(secs, 3),
        }
    return res


def cross_node_copies(old, new, node_of_slot):
    """New replicas whose expert had no copy in the destination node: a copy over the network."""
    n = 0
    for o, w in zip(old.tolist(), new.tolist()):
        had = {(int(node_of_slot[p]), e) for p, e in enumerate(o)}
        gained = {(int(node_of_slot[p]), e) for p, e in enumerate(w)} - had
        n += len(gained)
    return n


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return round(float(np.mean(xs)), 4) if xs else None


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="small run for smoke tests")
    ap.add_argument("--slack", type=float, default=0.01, help="for the ours_slack variant")
    ap.add_argument("--seeds", type=int, default=3)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)  # tiny tensors: threads only add overhead on a shared machine
    L, E, P, R, T, period = (2, 32, 40, 4, 60, 10) if args.quick else (4, 64, 80, 8, 240, 20)
    cfg = dict(
        layers=L,
        experts=E,
        physical=P,
        ranks=R,
        steps=T,
        period=period,
        tokens=1024,
        topk=4,
        slack=args.slack,
        seeds=args.seeds,
    )
    out = {"bench": "eplb", "config": cfg, "nodes1": {}, "nodes2": {}}
    for N, key in ((1, "nodes1"), (2, "nodes2")):
        for i, name in enumerate(("zipf", "drift", "coding")):
            # A few seeds: one phase switch landing on a lucky placement should not decide it.
            runs = [
                run(name, 1000 + 10 * i + k, L, E, P, R, N, T, period, 1024, 4, args.slack)
                for k in range(args.seeds)
            ]
            out[key][name] = {m: {f: _mean([r[m][f] for r in runs]) for f in runs[0][m]} for m in runs[0]}
    # Headline ratios, averaged over scenarios (single node): < 1 means ours is better.
    sc = out["nodes1"]

    def ratio(m, k):
        return round(float(np.mean([sc[s][m][k] / max(sc[s]["greedy"][k], 1e-9) for s in sc])), 4)

    for m in ("ours", f"ours_slack{args.slack:g}"):
        out[f"{m}_vs_greedy"] = {
            "max_mean_ratio": ratio(m, "max_mean"),
            "planned_max_mean_ratio": ratio(m, "planned_max_mean"),
            "moved_per_rebalance_ratio": ratio(m, "moved_per_rebalance"),
        }
    print(json.dumps(out, separators=(",", ":")))


if __name__ == "__main__":
    sys.exit(main())
