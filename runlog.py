"""
The run's log, on rank 0: a row per step in out_dir/metrics.jsonl (and the same
numbers as TensorBoard scalars with tensorboard_dir, to Weights & Biases with
wandb_project), and out_dir/curves.png, a grid of the curves people look at first.
"""
import json
import os


def log_step(out_dir, row, writer=None):
    """A row of out_dir/metrics.jsonl; its numbers to the writer
    too (scalar_writer's: TensorBoard, W&B) at its step."""
    with open(os.path.join(out_dir, "metrics.jsonl"), "a") as f:
        f.write(json.dumps(row) + "\n")
    if writer:
        writer.log({k: v for k, v in row.items() if isinstance(v, (int, float))
                    and not isinstance(v, bool)
                    and k != "step"}, row["step"])


def info_means(records):
    """{"info/KEY": mean over attempts} of the numbers agents
    returned in Result.info (an attempt counts once)."""
    per_attempt = {r["attempt_id"]: r.get("info") or {} for r in records}
    keys = sorted({k for info in per_attempt.values() for k in info})
    return {f"info/{k}": sum(info[k] for info in per_attempt.values() if k in info) /
            sum(k in info for info in per_attempt.values()) for k in keys}


class ScalarWriter:
    """Rank 0's copies of the logged numbers: TensorBoard scalars
    (tensorboard_dir) and a Weights & Biases run (wandb_project; its files
    under out_dir/wandb, the resolved config logged once, at the start)."""

    def __init__(self, cfg):
        self.tensorboard = self.wandb = None
        if cfg["tensorboard_dir"]:
            # the tensorboard package: plan.check_config asks for it
            from torch.utils.tensorboard import SummaryWriter
            self.tensorboard = SummaryWriter(cfg["tensorboard_dir"])
        if cfg["wandb_project"]:
            import wandb  # optional, as plan.check_config says; WANDB_MODE=offline needs no network
            self.wandb = wandb.init(project=cfg["wandb_project"], dir=cfg["out_dir"], config=cfg)

    def log(self, scalars, step):
        for key, value in scalars.items() if self.tensorboard else ():
            self.tensorboard.add_scalar(key, value, step)
        if self.wandb:
            self.wandb.log(scalars, step=step)

    def close(self):
        self.tensorboard and self.tensorboard.close()
        self.wandb and self.wandb.finish()


def scalar_writer(cfg, rank):
    if rank == 0 and (cfg["tensorboard_dir"] or cfg["wandb_project"]):  # else None
        return ScalarWriter(cfg)


PANELS = {"reward_mean": "train reward", "eval/success": "held-out success (eval)",
          "mismatch_kl": "engine/trainer KL",
          "response_tokens": "generated tokens per attempt", "tokens_per_s": "generated tokens/s",
          "loss": "loss", "entropy": "entropy (entropy_coef > 0)",
          "kl_ref": "KL to the reference (kl_coef > 0)",
          "step_time_s": "seconds per step: where they go"}


# drawn in the same panel when the log has them: the image ablation beside eval/success; the
# step's phases (placement="colocated" adds the engine's sleep and wake, which sync_s includes)
OVERLAYS = {"eval/success": ("eval/success_blank",),
            "step_time_s": ("batch_wait_s", "train_step_s", "sync_s", "sleep_s", "wake_s",
                            "idle_s")}


def plot_metrics(out_dir):
    """out_dir/curves.png from metrics.jsonl (all steps, including
    those before a resume): a grid of the PANELS that the log has."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    panels = [(key, title) for key, title in PANELS.items()
              if any(r.get(key) is not None for r in rows)]
    n = max(2, -(-len(panels) // 3))  # rows of three panels
    fig, axes = plt.subplots(n, 3, figsize=(12, 2.8 * n))
    for ax, (key, title) in zip(axes.flat, panels):
        for line in (key, *OVERLAYS.get(key, ())):
            if points := [(r["step"], r[line]) for r in rows if r.get(line) is not None]:
                ax.plot(*zip(*points), marker=".", label=line)
        if any(r.get(line) is not None for r in rows for line in OVERLAYS.get(key, ())):
            ax.legend(fontsize=7)
        ax.set(title=title, xlabel="step")
        ax.grid(alpha=0.3)
    for ax in axes.flat[len(panels):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "curves.png"), dpi=80)
    plt.close(fig)
