"""AAPS for continuous control: SB3's SAC with its actor on the workers, under each sync policy.

    python benchmarks/aaps_continuous.py                   # Pendulum-v1, 3 seeds, 20k steps, KL 0.1/0.5/2
    python benchmarks/aaps_continuous.py --env-id HalfCheetah-v5 --steps 50000 --thresholds 4 8 16 \
        --json benchmarks/results/aaps_continuous_halfcheetah.json   # about an hour
    python benchmarks/aaps_continuous.py --plot-only

Each run is ``clusterenv_sb3.SAC`` on 2 envs (``train_freq=8`` vector steps, as many gradient
steps; one ``train()`` is one "update") with ``AAPSCallback`` in one mode: ``always`` (the actor's
weights after every update), ``aaps`` at each ``--thresholds`` value (mean KL between the workers'
and the learner's actor Gaussians, before the tanh, on recent states) or ``never``; then
``always`` and the middle threshold again with ``overlap_collection`` (the next segment collected
while the learner trains). Recorded per run: the mean return of the last 20 training episodes, the
mean return of the deterministic actor over 10 fresh episodes, syncs, updates, weight bytes sent,
wall time. JSON (rewritten after every run) and a PNG; the target evaluated: some threshold within
5% of ``always``'s return with at least 10x fewer syncs, on both return measures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import measuring  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def run(env_id: str, steps: int, seed: int, mode: str, threshold: float | None, overlap: bool) -> dict:
    import gymnasium as gym
    import numpy as np
    import torch
    from stable_baselines3.common.env_util import make_vec_env
    from stable_baselines3.common.evaluation import evaluate_policy

    from clusterenv_sb3 import SAC, AAPSCallback, ClusterVecEnv

    torch.set_num_threads(1)  # the workers share the two cores
    env = make_vec_env(env_id, n_envs=2, seed=seed, vec_env_cls=ClusterVecEnv)
    try:
        started = time.monotonic()
        model = SAC(
            "MlpPolicy", env, seed=seed, learning_starts=1000, train_freq=8, gradient_steps=8, learning_rate=1e-3,
            policy_kwargs={"net_arch": [64, 64]}, overlap_collection=overlap,
        )
        callback = AAPSCallback(mode=mode, kl_threshold=threshold if threshold is not None else 0.01)
        model.learn(steps, callback=callback)
        seconds = time.monotonic() - started
        training = float(np.mean([info["r"] for info in list(model.ep_info_buffer)[-20:]]))
        eval_env = gym.make(env_id)
        eval_env.reset(seed=10_000 + seed)  # evaluate_policy's resets continue this seeded generator
        evaluation, _ = evaluate_policy(model, eval_env, n_eval_episodes=10, deterministic=True, warn=False)
        summary = model.policy_sync.summary()
    finally:
        env.close()
    return {
        "env_id": env_id, "seed": seed, "mode": mode, "threshold": threshold, "overlap": overlap, "steps": steps,
        "train_return": training, "eval_return": float(evaluation), "syncs": summary["syncs"],
        "updates": summary["updates"], "weight_bytes_sent": summary["weight_bytes_sent"], "seconds": round(seconds, 1),
    }


def configurations(thresholds: list[float]) -> list[tuple[str, float | None, bool]]:
    middle = thresholds[len(thresholds) // 2]
    return [
        ("always", None, False),
        *[("aaps", threshold, False) for threshold in thresholds],
        ("never", None, False),
        ("always", None, True),
        ("aaps", middle, True),
    ]


def label(mode: str, threshold: float | None, overlap: bool) -> str:
    name = f"aaps {threshold:g}" if mode == "aaps" else mode
    return name + (" + overlap" if overlap else "")


def table(runs: list[dict]) -> tuple[list[dict], dict]:
    groups: dict[str, list[dict]] = {}
    for entry in runs:
        groups.setdefault(label(entry["mode"], entry["threshold"], entry["overlap"]), []).append(entry)
    rows = []
    for name, entries in groups.items():
        rows.append({
            "config": name,
            "seeds": len(entries),
            "train_return": statistics.mean(e["train_return"] for e in entries),
            "eval_return": statistics.mean(e["eval_return"] for e in entries),
            "syncs": statistics.mean(e["syncs"] for e in entries),
            "updates": statistics.mean(e["updates"] for e in entries),
            "weight_mb": statistics.mean(e["weight_bytes_sent"] for e in entries) / 1e6,
            "seconds": statistics.mean(e["seconds"] for e in entries),
        })
    baseline = next((row for row in rows if row["config"] == "always"), None)
    target = {"met": False, "by": None}
    if baseline:
        for row in rows:
            if not row["config"].startswith("aaps") or "overlap" in row["config"] or row["syncs"] == 0:
                continue
            close = all(
                row[key] >= baseline[key] - 0.05 * abs(baseline[key]) for key in ("train_return", "eval_return")
            )
            if close and baseline["syncs"] / row["syncs"] >= 10:
                target = {"met": True, "by": row["config"]}
    return rows, target


def plot(runs: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, _ = table(runs)
    figure, axis = plt.subplots(figsize=(7, 4))
    for row in rows:
        marker = "s" if "overlap" in row["config"] else "o"
        axis.scatter(max(row["syncs"], 0.5), row["eval_return"], marker=marker)
        axis.annotate(row["config"], (max(row["syncs"], 0.5), row["eval_return"]), fontsize=8, xytext=(4, 4),
                      textcoords="offset points")
    axis.set_xscale("log")
    axis.set_xlabel("weight syncs per run (log; never plotted at 0.5)")
    axis.set_ylabel("deterministic evaluation return")
    axis.set_title(f"SAC with worker-side actors, {runs[0]['env_id']}, mean over seeds")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--env-id", default="Pendulum-v1")
    parser.add_argument("--steps", type=int, default=20_000)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--thresholds", type=float, nargs="+", default=[0.1, 0.5, 2.0],
                        help="KL thresholds; a 6-dim action space (HalfCheetah) drifts more per update: 4 8 16")
    parser.add_argument("--json", default=os.path.join(RESULTS, "aaps_continuous.json"))
    parser.add_argument("--plot-only", action="store_true")
    args = parser.parse_args()
    png = os.path.splitext(args.json)[0] + ".png"
    if args.plot_only:
        with open(args.json) as file:
            plot(json.load(file)["runs"], png)
        return
    runs: list[dict] = []
    for mode, threshold, overlap in configurations(args.thresholds):
        for seed in args.seeds:
            entry = run(args.env_id, args.steps, seed, mode, threshold, overlap)
            runs.append(entry)
            print(
                f"{label(mode, threshold, overlap):18} seed {seed}: train {entry['train_return']:8.1f}  "
                f"eval {entry['eval_return']:8.1f}  syncs {entry['syncs']:5d}/{entry['updates']}  {entry['seconds']:6.1f} s",
                flush=True,
            )
            rows, target = table(runs)
            record = {"command": measuring.command(), "rows": rows, "target": target, "runs": runs}
            measuring.write_json(args.json, record)
    rows, target = table(runs)
    print("\n| configuration | train return | eval return | syncs / updates | weights MB | s per run |")
    print("|---|---:|---:|---:|---:|---:|")
    for row in rows:
        print(f"| {row['config']} | {row['train_return']:.1f} | {row['eval_return']:.1f} | "
              f"{row['syncs']:.0f} / {row['updates']:.0f} | {row['weight_mb']:.2f} | {row['seconds']:.0f} |")
    print(f"target (within 5% of always with >= 10x fewer syncs): {target}")
    plot(runs, png)
    print(f"wrote {args.json} and {png}")


if __name__ == "__main__":
    main()
