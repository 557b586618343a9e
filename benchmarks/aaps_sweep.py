"""AAPS sweep: PPO with worker-side inference under each sync policy, on CartPole-v1 and LunarLander-v3.

    python benchmarks/aaps_sweep.py                 # the full sweep (see --help for step counts)
    python benchmarks/aaps_sweep.py --quick         # a smoke run: few steps, one seed, two thresholds
    python benchmarks/aaps_sweep.py --plot-only     # redraw the PNG from the JSON
    python benchmarks/aaps_sweep.py --envs CartPole-v1 --json a.json & python benchmarks/aaps_sweep.py \
        --envs LunarLander-v3 --json b.json; python benchmarks/aaps_sweep.py --merge a.json b.json

Each run is ``examples/cleanrl/ppo_aaps.py`` (its ``train`` function, imported) with one sync
policy: ``always``, ``aaps`` at each ``--thresholds`` value (mean KL of the workers' policy to the
learner's on recent states) or ``never``; ``--seeds`` seeds each. Recorded per run: the mean return
of the last 20 training episodes, the mean return of the greedy policy over ``--eval-episodes``
fresh episodes, syncs, learner updates, weight bytes sent, the policy lag of the collected steps
(in learner updates), wall time, and the return curve (mean of the last 20 episodes after every
PPO iteration). Results go to ``benchmarks/results/aaps_sweep.json`` (rewritten after every run;
``--resume`` skips runs already there) and ``benchmarks/results/aaps_sweep.png``.

What one "update" is (``--sync-every``, default ``minibatch``): every PPO optimizer step, with the
next segment collected while the learner trains (``--overlap``, default on). That is the setting in
which a sync can change the data at all: the workers are collecting while the learner steps, and
(local backend) pick new weights up at their next env step. ``always`` then ships the weights
``update_epochs * num_minibatches`` (16) times per iteration, the freshest and most expensive
actor, and AAPS decides after every step whether the drift is worth shipping. With
``--sync-every iteration`` (once per PPO iteration, after all epochs) ``always`` is already cheap
and a stale actor costs a whole iteration of drift per skipped sync; without overlap the workers
are idle while the learner trains, so only the last sync before a segment matters.

The target evaluated (``target`` in the JSON): some AAPS threshold reaches a mean return within 5%
of ``always`` with at least 10x fewer syncs, per environment, on both return measures.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
from pathlib import Path

import measuring
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


def load_ppo_aaps():
    """``examples/cleanrl/ppo_aaps.py`` as a module (examples are scripts, not a package). Its
    directory goes on ``sys.path``, which the workers inherit, so they can unpickle its ``Agent``."""
    sys.path.insert(0, str(ROOT / "examples" / "cleanrl"))
    return importlib.import_module("ppo_aaps")


def policies(thresholds: list[float]) -> list[tuple[str, str, float | None]]:
    """(label, mode, threshold) of every sync policy of the sweep."""
    return [("always", "always", None)] + [(f"aaps {t:g}", "aaps", t) for t in thresholds] + [("never", "never", None)]


def run_one(ppo, env_id: str, steps: int, mode: str, threshold: float | None, seed: int, opts) -> dict:
    args = ppo.Args(
        seed=seed,
        env_id=env_id,
        total_timesteps=steps,
        sync=mode,
        kl_threshold=threshold if threshold is not None else 0.0,
        sync_every=opts.sync_every,
        overlap=opts.overlap,
        ppo_ratio=opts.ppo_ratio,
        max_behaviour_weight=opts.max_behaviour_weight,
        num_workers=opts.num_workers,
        eval_episodes=opts.eval_episodes,
        track_dir=None,
        log_every=0,
    )
    started = time.time()
    result = ppo.train(args)
    result["wall_seconds"] = time.time() - started  # includes starting the workers and the evaluation
    return result


def summarize(runs: list[dict], labels: list[str], envs: list[str]) -> dict:
    """Per env and policy: mean ± std over seeds of the returns, and mean syncs, bytes, lag, time."""
    table: dict = {}
    for env_id in envs:
        table[env_id] = {}
        for label in labels:
            rows = [r for r in runs if r["env_id"] == env_id and r["policy"] == label]
            if not rows:
                continue

            def stat(key, rows=rows):
                values = np.array([r[key] for r in rows], dtype=float)
                return float(values.mean()), float(values.std())

            table[env_id][label] = {
                "seeds": len(rows),
                "train_return": stat("final_train_return"),
                "eval_return": stat("eval_return"),
                "syncs": stat("syncs")[0],
                "updates": stat("updates")[0],
                "weight_bytes_sent": stat("weight_bytes_sent")[0],
                "mean_update_lag": stat("mean_update_lag")[0],
                "wall_seconds": stat("wall_seconds")[0],
            }
    return table


def evaluate_target(table: dict) -> dict:
    """Per env and return measure: AAPS thresholds within 5% of ``always`` with >= 10x fewer syncs.

    ``never_within`` says whether ``never`` (no sync at all) is within 5% too: then the measure
    cannot tell a synced actor from a frozen one, and a pass on it means nothing.
    """
    verdict: dict = {}
    for env_id, rows in table.items():
        if "always" not in rows:
            continue
        base = rows["always"]
        verdict[env_id] = {}
        for measure in ("train_return", "eval_return"):

            def within(row, measure=measure):
                # "Within 5%": at most 5% of |always's return| below it (returns may be negative).
                return row[measure][0] >= base[measure][0] - 0.05 * abs(base[measure][0])

            passing = []
            for label, row in rows.items():
                if label.startswith("aaps") and within(row) and row["syncs"] * 10 <= base["syncs"]:
                    reduction = base["syncs"] / row["syncs"] if row["syncs"] else None  # None: no sync at all
                    passing.append({"policy": label, "return": row[measure][0], "syncs": row["syncs"],
                                    "sync_reduction": reduction})
            never_within = "never" in rows and within(rows["never"])
            verdict[env_id][measure] = {
                "always": base[measure][0],
                "met": bool(passing) and not never_within,
                "never_within": never_within,
                "passing": passing,
            }
    return verdict


def _num(value: float) -> str:
    """Short label: whole numbers from 10 on, three significant digits below."""
    return f"{value:.0f}" if value >= 10 or value == 0 else f"{value:.3g}"


def plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    envs, labels = data["config"]["envs"], data["config"]["policies"]
    cmap = plt.get_cmap("viridis")
    aaps_labels = [label for label in labels if label.startswith("aaps")]
    colors = {"always": "black", "never": "tab:red"}
    colors.update({label: cmap(0.8 * i / max(1, len(aaps_labels) - 1)) for i, label in enumerate(aaps_labels)})

    fig, axes = plt.subplots(len(envs), 3, figsize=(17, 4.6 * len(envs)), squeeze=False)
    for row, env_id in enumerate(envs):
        table = data["summary"].get(env_id, {})
        ax_curve, ax_return, ax_syncs = axes[row]
        for label in labels:
            runs = [r for r in data["runs"] if r["env_id"] == env_id and r["policy"] == label]
            if not runs:
                continue
            length = min(len(r["curve"]) for r in runs)
            steps = np.array([point[0] for point in runs[0]["curve"][:length]])
            returns = np.array([[point[1] for point in r["curve"][:length]] for r in runs], dtype=float)
            mean = np.nanmean(returns, axis=0)
            ax_curve.plot(steps, mean, color=colors[label], label=label, lw=2 if label in ("always", "never") else 1.4)
        seeds = len({run["seed"] for run in data["runs"] if run["env_id"] == env_id})
        ax_curve.set_title(f"{env_id}: training return (last 20 episodes, mean of {seeds} seeds)")
        frozen = [label for label in labels if label.startswith("aaps") and table.get(label, {}).get("syncs", 1) == 0]
        if frozen:  # their curves are never's (same data), drawn under it
            ax_curve.text(0.99, 0.02, f"0 syncs, curve = never: {', '.join(frozen)}", transform=ax_curve.transAxes,
                          ha="right", va="bottom", fontsize=8, color="tab:red")
        ax_curve.set_xlabel("environment steps")
        ax_curve.set_ylabel("episodic return")
        ax_curve.grid(alpha=0.3)
        ax_curve.legend(fontsize=8, loc="upper left")

        present = [label for label in labels if label in table]
        x = np.arange(len(present))
        width = 0.4
        for offset, measure, hatch in ((-width / 2, "train_return", ""), (width / 2, "eval_return", "//")):
            ax_return.bar(
                x + offset,
                [table[label][measure][0] for label in present],
                width,
                yerr=[table[label][measure][1] for label in present],
                color=[colors[label] for label in present],
                hatch=hatch,
                edgecolor="white" if not hatch else "gray",
                capsize=3,
                label="training (last 20 episodes)" if not hatch else "greedy evaluation",
            )
        if "always" in table:
            base = table["always"]["train_return"][0]
            ax_return.axhline(base - 0.05 * abs(base), color="black", ls=":", lw=1, label="always - 5% (training)")
        ax_return.set_xticks(x, present, rotation=30, ha="right", fontsize=9)
        ax_return.set_title(f"{env_id}: final return (mean ± std over seeds)")
        ax_return.legend(fontsize=8)
        ax_return.grid(alpha=0.3, axis="y")

        syncs = [max(table[label]["syncs"], 0.5) for label in present]
        bars = ax_syncs.bar(x, syncs, color=[colors[label] for label in present])
        for bar, label in zip(bars, present):
            row_data = table[label]
            ax_syncs.annotate(
                f"{_num(row_data['syncs'])}\n{_num(row_data['weight_bytes_sent'] / 1e6)} MB",
                (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                ha="center",
                va="bottom",
                fontsize=8,
            )
        ax_syncs.set_yscale("log")
        ax_syncs.set_ylim(0.4, max(syncs) * 8)
        ax_syncs.set_xticks(x, present, rotation=30, ha="right", fontsize=9)
        updates = table.get("always", {}).get("updates", float("nan"))
        ax_syncs.set_title(f"{env_id}: syncs per run (of {updates:.0f} updates; weights sent)")
        ax_syncs.grid(alpha=0.3, axis="y")
    config = data["config"]
    fig.suptitle(
        f"PPO with worker-side inference: sync policies (update = {config['sync_every']}, "
        f"overlap={config['overlap']}, ratio = {config.get('ppo_ratio', 'behaviour')}, {config['steps']})",
        fontsize=12,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def format_table(data: dict) -> str:
    lines = [
        "| env | policy | training return | greedy eval return | syncs | weights sent | update lag | wall time |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for env_id, rows in data["summary"].items():
        for label, row in rows.items():
            lines.append(
                f"| {env_id} | {label} | {row['train_return'][0]:.1f} ± {row['train_return'][1]:.1f} | "
                f"{row['eval_return'][0]:.1f} ± {row['eval_return'][1]:.1f} | {row['syncs']:.3g} / {row['updates']:.0f} | "
                f"{row['weight_bytes_sent'] / 1e6:.2f} MB | {row['mean_update_lag']:.2f} | {row['wall_seconds']:.0f} s |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--envs", nargs="+", default=["CartPole-v1", "LunarLander-v3"])
    parser.add_argument("--cartpole-steps", type=int, default=100_000, help="environment steps per CartPole run")
    parser.add_argument("--lunar-steps", type=int, default=150_000, help="environment steps per LunarLander run")
    parser.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    parser.add_argument("--thresholds", nargs="+", type=float, default=[0.001, 0.01, 0.05, 0.1, 0.5])
    parser.add_argument("--sync-every", choices=["iteration", "minibatch"], default="minibatch")
    parser.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--ppo-ratio", choices=["proximal", "behaviour"], default="proximal",
                        help="decoupled PPO (clip relative to the learner's policy) or clip relative to the workers'")
    parser.add_argument("--max-behaviour-weight", type=float, default=2.0,
                        help="decoupled PPO: truncation of the importance weights pi_learner / pi_workers")
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--eval-episodes", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="20k steps, seed 1, thresholds 0.01 and 0.1")
    parser.add_argument("--resume", action="store_true", help="keep the runs already in the JSON, do the rest")
    parser.add_argument("--plot-only", action="store_true", help="redraw the PNG (and print the table) from the JSON")
    parser.add_argument("--merge", nargs="+", type=Path, help="merge these sweep JSONs (e.g. one per env) into --json")
    parser.add_argument("--json", type=Path, default=RESULTS / "aaps_sweep.json")
    parser.add_argument("--png", type=Path, default=RESULTS / "aaps_sweep.png")
    opts = parser.parse_args()

    if opts.merge:
        parts = [json.loads(path.read_text()) for path in opts.merge]
        config = dict(parts[0]["config"])
        config["envs"] = [env_id for part in parts for env_id in part["config"]["envs"]]
        config["steps"] = {k: v for part in parts for k, v in part["config"]["steps"].items()}
        config["seeds"] = {env_id: part["config"]["seeds"] for part in parts for env_id in part["config"]["envs"]}
        config["command"] = [part["config"]["command"] for part in parts]
        runs = [run for part in parts for run in part["runs"]]
        data = {"config": config, "runs": runs, "summary": summarize(runs, config["policies"], config["envs"])}
        data["target"] = evaluate_target(data["summary"])
        data["sweep_seconds"] = {part["config"]["envs"][0]: part["sweep_seconds"] for part in parts}
        measuring.write_json(opts.json, data)
        opts.plot_only = True
    if opts.plot_only:
        data = json.loads(opts.json.read_text())
        plot(data, opts.png)
        print(format_table(data))
        print(json.dumps(data["target"], indent=1))
        return
    if opts.quick:
        opts.cartpole_steps = opts.lunar_steps = 20_000
        opts.seeds, opts.thresholds = [1], [0.01, 0.1]
    steps = {"CartPole-v1": opts.cartpole_steps, "LunarLander-v3": opts.lunar_steps}
    sweep = policies(opts.thresholds)
    labels = [label for label, _, _ in sweep]
    config = {
        "envs": opts.envs,
        "steps": {env_id: steps.get(env_id, opts.cartpole_steps) for env_id in opts.envs},
        "seeds": opts.seeds,
        "thresholds": opts.thresholds,
        "policies": labels,
        "sync_every": opts.sync_every,
        "overlap": opts.overlap,
        "ppo_ratio": opts.ppo_ratio,
        "max_behaviour_weight": opts.max_behaviour_weight,
        "num_workers": opts.num_workers,
        "eval_episodes": opts.eval_episodes,
        "ppo": "examples/cleanrl/ppo_aaps.py defaults (4 envs x 128 steps, 4 epochs x 4 minibatches)",
        "cpus": os.cpu_count(),
        "command": measuring.command(),
    }
    runs: list[dict] = []
    if opts.resume and opts.json.exists():
        runs = [r for r in json.loads(opts.json.read_text())["runs"]]
    done = {(r["env_id"], r["policy"], r["seed"]) for r in runs}

    ppo = load_ppo_aaps()
    sweep_start = time.time()
    for env_id in opts.envs:
        for seed in opts.seeds:
            for label, mode, threshold in sweep:
                if (env_id, label, seed) in done:
                    continue
                result = run_one(ppo, env_id, config["steps"][env_id], mode, threshold, seed, opts)
                sync = result["sync"]
                runs.append(
                    {
                        "env_id": env_id,
                        "policy": label,
                        "mode": mode,
                        "threshold": threshold,
                        "seed": seed,
                        "steps": result["global_step"],
                        "final_train_return": result["final_train_return"],
                        "eval_return": float(np.mean(result["eval_returns"])) if result["eval_returns"] else float("nan"),
                        "eval_returns": result["eval_returns"],
                        "syncs": sync["syncs"],
                        "updates": sync["updates"],
                        "weight_bytes_sent": sync["weight_bytes_sent"],
                        "mean_update_lag": sync["mean_update_lag"],
                        "mean_policy_lag_versions": sync["mean_policy_lag"],
                        "train_seconds": result["train_seconds"],
                        "wall_seconds": result["wall_seconds"],
                        "curve": result["curve"],
                    }
                )
                print(
                    f"[{time.time() - sweep_start:6.0f} s] {env_id} {label:>10} seed {seed}: "
                    f"train {runs[-1]['final_train_return']:.1f}, eval {runs[-1]['eval_return']:.1f}, "
                    f"syncs {sync['syncs']}/{sync['updates']}, {result['wall_seconds']:.0f} s",
                    flush=True,
                )
                data = {"config": config, "runs": runs}
                data["summary"] = summarize(runs, labels, opts.envs)
                data["target"] = evaluate_target(data["summary"])
                data["sweep_seconds"] = time.time() - sweep_start
                measuring.write_json(opts.json, data)
    data = json.loads(opts.json.read_text())
    plot(data, opts.png)
    print(format_table(data))
    print(json.dumps(data["target"], indent=1))


if __name__ == "__main__":
    main()
