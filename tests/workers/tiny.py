"""A small deterministic model and dataset shared by the multi-process workers and the tests."""

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset


class IndexedData(Dataset):
    """``n`` samples ``(x (8,) float32, y int64 in 0..3, index)``, identical on every rank (seed 0)."""

    def __init__(self, n: int = 64) -> None:
        gen = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 8, generator=gen)
        self.y = torch.randint(0, 4, (n,), generator=gen)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i], i


def tiny_net() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


class TinyModule(pl.LightningModule):
    """Records what each rank saw: start/end parameters, learning rates, sample indices, first batch."""

    def __init__(
        self,
        lr: float = 0.1,
        momentum: float = 0.5,
        n: int = 64,
        batch_size: int = 4,
        scheduler: str = "none",
        optimizer: str = "sgd",
    ) -> None:
        super().__init__()
        self.net = tiny_net()
        self.lr, self.momentum, self.n, self.batch_size = lr, momentum, n, batch_size
        self.scheduler, self.optimizer_name = scheduler, optimizer
        self.record = {"indices": [], "batches": [], "lrs": []}

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y, idx = batch
        self.record["indices"] += idx.tolist()
        if len(self.record["batches"]) < 4:
            self.record["batches"].append((x.clone(), y.clone()))
        self.record["lrs"].append(self.trainer.optimizers[0].param_groups[0]["lr"])
        loss = F.cross_entropy(self(x), y)
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

    def train_dataloader(self):
        return DataLoader(IndexedData(self.n), batch_size=self.batch_size, shuffle=False)

    def configure_optimizers(self):
        if self.optimizer_name == "adam":
            opt = torch.optim.Adam(self.parameters(), lr=self.lr)
        else:
            opt = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)
        if self.scheduler == "step":
            return {
                "optimizer": opt,
                "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5),
            }
        if self.scheduler == "onecycle":
            sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=self.lr, total_steps=10_000)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
        return opt
