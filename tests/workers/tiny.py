"""Small deterministic models and data shared by the multi-process workers and the tests."""

import os
import signal

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from tests.workers.lightning import pl
from tests.workers.samples import IndexedData, tiny_net

__all__ = [
    "IndexedData",
    "tiny_net",
    "TinyModule",
    "FrozenBranchModule",
    "TwoOptimizerModule",
    "TransformerModule",
    "MODULES",
]


class TinyModule(pl.LightningModule):
    """Records what each rank saw: start/end parameters, learning rates, sample indices, first batches.

    ``loss_scale`` multiplies the loss; ``zero_loss_rank`` zeroes that rank's loss (its update is all
    zeros); ``kill_rank``/``kill_at_step`` SIGKILL that rank at that global step; ``inf_rank``/``inf_step``
    make that rank's loss infinite at that global step (a gradient scaler then skips its step).
    """

    def __init__(
        self,
        lr: float = 0.1,
        momentum: float = 0.5,
        n: int = 64,
        batch_size: int = 4,
        scheduler: str = "none",
        optimizer: str = "sgd",
        loss_scale: float = 1.0,
        zero_loss_rank: int = -1,
        kill_rank: int = -1,
        kill_at_step: int = -1,
        inf_rank: int = -1,
        inf_step: int = -1,
    ) -> None:
        super().__init__()
        self.net = tiny_net()
        self.lr, self.momentum, self.n, self.batch_size = lr, momentum, n, batch_size
        self.scheduler, self.optimizer_name = scheduler, optimizer
        self.loss_scale, self.zero_loss_rank = loss_scale, zero_loss_rank
        self.kill_rank, self.kill_at_step = kill_rank, kill_at_step
        self.inf_rank, self.inf_step = inf_rank, inf_step
        self.record = {"indices": [], "batches": [], "lrs": [], "epoch_start_delays": []}

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y, idx = batch
        self.record["indices"] += idx.tolist()
        if len(self.record["batches"]) < 6:
            self.record["batches"].append((x.clone(), y.clone()))
        self.record["lrs"].append(self.trainer.optimizers[0].param_groups[0]["lr"])
        if self.global_rank == self.kill_rank and self.global_step == self.kill_at_step:
            os.kill(os.getpid(), signal.SIGKILL)  # a rank dying mid-training
        loss = F.cross_entropy(self(x), y) * self.loss_scale
        if self.global_rank == self.inf_rank and self.global_step == self.inf_step:
            loss = loss * float("inf")  # overflowing gradients on this rank only
        if self.global_rank == self.zero_loss_rank:
            loss = loss * 0.0  # this rank's update is all zeros
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def on_train_start(self):
        opt = self.trainer.optimizers[0]
        self.record["start"] = {k: v.detach().clone() for k, v in self.state_dict().items()}
        self.record["start_lr"] = opt.param_groups[0]["lr"]
        self.record["optimizer_class"] = type(opt).__mro__[1].__name__ + "/" + type(opt).__module__
        configs = self.trainer.lr_scheduler_configs
        self.record["base_lrs"] = list(configs[0].scheduler.base_lrs) if configs else None
        self.record["global_step_start"] = self.trainer.global_step
        self.record["start_opt_state"] = {
            k: {n: t.clone() for n, t in s.items() if torch.is_tensor(t)}
            for k, s in opt.state_dict()["state"].items()
        }

    def on_train_epoch_start(self):
        # Horovod's per-parameter countdown of backward passes and its pending handles: a window left
        # over from the previous epoch would show here.
        opt = self.trainer.optimizers[0]
        delays = getattr(opt, "_allreduce_delay", None)
        self.record["epoch_start_delays"].append(
            (sorted(set(delays.values())), len(opt._handles)) if delays is not None else None
        )

    def train_dataloader(self):
        return DataLoader(IndexedData(self.n), batch_size=self.batch_size, shuffle=False)

    def configure_optimizers(self):
        if self.optimizer_name == "lbfgs":
            return torch.optim.LBFGS(self.parameters(), lr=self.lr, max_iter=5)
        if self.optimizer_name == "adam":
            opt = torch.optim.Adam(self.parameters(), lr=self.lr)
        else:
            opt = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)
        if self.scheduler == "step":
            return {
                "optimizer": opt,
                "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5),
            }
        if self.scheduler == "onecycle":
            sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=self.lr, total_steps=10_000)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
        return opt


class FrozenBranchModule(TinyModule):
    """Adds a frozen layer (requires_grad=False) and a branch used only by batches whose first feature
    has a positive mean: on some steps, and on some ranks only, the branch gets no gradient."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.frozen = nn.Linear(8, 8)
        self.frozen.requires_grad_(False)
        self.branch = nn.Linear(8, 4)
        self.record["branch_used"] = []

    def forward(self, x):
        h = self.frozen(x)
        out = self.net(h)
        used = bool(x[:, 0].mean() > 0)
        self.record["branch_used"].append(used)
        return out + self.branch(h) if used else out


class TwoOptimizerModule(TinyModule):
    """Manual optimisation with two optimizers over disjoint parameters (``net``: SGD, ``head``: Adam)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.head = nn.Linear(8, 4)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        x, y, idx = batch
        self.record["indices"] += idx.tolist()
        self.record["lrs"].append(self.trainer.optimizers[0].param_groups[0]["lr"])
        for opt, module in zip(self.optimizers(), (self.net, self.head), strict=True):
            self.toggle_optimizer(opt)
            loss = F.cross_entropy(module(x), y)
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()
            self.untoggle_optimizer(opt)

    def configure_optimizers(self):
        return (
            torch.optim.SGD(self.net.parameters(), lr=self.lr, momentum=self.momentum),
            torch.optim.Adam(self.head.parameters(), lr=0.01),
        )


class TransformerModule(TinyModule):
    """A one-layer transformer encoder (attention, LayerNorm, feed-forward; no dropout) over each sample's 8
    features read as a sequence of 2 tokens of width 4, then a linear head: the parameter kinds of
    Lightning's transformer example."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        layer = nn.TransformerEncoderLayer(
            d_model=4, nhead=2, dim_feedforward=8, dropout=0.0, batch_first=True
        )
        self.net = nn.Sequential(
            nn.Unflatten(1, (2, 4)),
            nn.TransformerEncoder(layer, 1, enable_nested_tensor=False),
            nn.Flatten(),
            nn.Linear(8, 4),
        )


MODULES = {
    "tiny": TinyModule,
    "frozen_branch": FrozenBranchModule,
    "two_optimizers": TwoOptimizerModule,
    "transformer": TransformerModule,
}
