"""The Lightning adapter: a LightningModule and a LightningDataModule trained elastic, equal to
a one-device Lightning Trainer given the same batches; its logged values in planaria's metrics;
what it refuses, by name."""

from __future__ import annotations

import importlib
import sys

import pytest

pl = pytest.importorskip("pytorch_lightning")  # lightning.pytorch works too; this one is pinned

import ray  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, Dataset, IterableDataset  # noqa: E402

import planaria  # noqa: E402
from planaria import ConfigError, RunConfig, UserCodeError  # noqa: E402
from planaria.data.plan import DataPlan  # noqa: E402
from planaria.data.randomness import factory_seed, seed_globals  # noqa: E402
from planaria.integrations import lightning as adapter  # noqa: E402
from tests.assertions import (  # noqa: E402
    assert_exactly_once,
    assert_one_kill_healed_by_a_transfer,
    assert_the_reference_training,
    drive,
    events,
    of,
    run_with_evals,
)

# The workers unpickle this module's helpers by value: they cannot import the tests package.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

N, G, M, STEPS, DIM, CLASSES = 256, 32, 8, 12, 16, 4
VAL_N, VAL_BS = 50, 8  # 7 batches, the last of 2 samples


class Blobs(Dataset):
    """Four classes of points around fixed centres: deterministic, map-style."""

    def __init__(self, n: int = N, skip: int = 0) -> None:
        """The points skip..skip+n of the draw (a validation set: skip=N)."""
        g = torch.Generator().manual_seed(0)
        centres = 2.0 * torch.randn(CLASSES, DIM, generator=g)
        self.y = torch.randint(0, CLASSES, (skip + n,), generator=g)[skip:]
        self.x = centres[self.y] + torch.randn(skip + n, DIM, generator=g)[skip:]

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


class LitMLP(pl.LightningModule):
    """A small MLP classifier with a per-step warm-up (LambdaLR in a scheduler dict) and
    ``self.log`` of its loss and accuracy."""

    def __init__(self, scheduler: str = "lambda") -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(DIM, 32), nn.ReLU(), nn.Linear(32, CLASSES))
        self.scheduler_kind = scheduler

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        loss = nn.functional.cross_entropy(logits, y)
        self.log("train_loss", loss)
        self.log_dict({"train_acc": (logits.argmax(1) == y).float().mean()})
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.log("val_loss", nn.functional.cross_entropy(logits, y))
        self.log_dict({"val_acc": (logits.argmax(1) == y).float().mean()})

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.01)
        if self.scheduler_kind == "lambda":
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
        else:
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        return {"optimizer": opt,
                "lr_scheduler": {"scheduler": sched, "interval": "step", "frequency": 1}}


class BlobData(pl.LightningDataModule):
    def setup(self, stage: str) -> None:
        self.train = Blobs()

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train, batch_size=7, shuffle=True)  # planaria's plan decides


def val_set() -> Blobs:
    return Blobs(VAL_N, skip=N)


def val_collate(samples: list) -> tuple[torch.Tensor, torch.Tensor]:
    """The val loader's own collate (the training's is default_collate): (x, y) as lists."""
    return torch.stack([x for x, _ in samples]), torch.stack([y for _, y in samples])


def val_loader() -> DataLoader:
    return DataLoader(val_set(), batch_size=VAL_BS, collate_fn=val_collate)


class ValBlobData(BlobData):
    """BlobData with a validation loader: its dataset, batch_size and collate_fn are the
    eval set's."""

    def val_dataloader(self) -> DataLoader:
        return val_loader()


class ManualMLP(LitMLP):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False


# ---- the target: equal to a one-device Lightning Trainer -----------------------------------

def trainer_reference(steps: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """A one-device Lightning Trainer fed planaria's batches: the plan's sample order, in
    micro-batches of M accumulated over G // M (Lightning divides each micro-batch's loss by
    that count: the gradient is the mean of micro-batch means, as planaria's is), the model
    built as planaria's workers build it (the generators seeded from the spec's seed)."""
    plan, data = DataPlan(N, G, seed), Blobs()
    ordered = [data[int(i)] for s in range(steps) for i in plan.batch(s)]
    seed_globals(factory_seed(seed, "model"))
    module = LitMLP()
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=steps,
                         accumulate_grad_batches=G // M, enable_checkpointing=False,
                         logger=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, deterministic=True)
    try:
        trainer.fit(module, train_dataloaders=DataLoader(ordered, batch_size=M, shuffle=False))
    finally:
        torch.use_deterministic_algorithms(False)
    assert trainer.global_step == steps
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


@pytest.mark.multiprocess
@pytest.mark.slow
def test_equal_to_a_lightning_trainer_with_a_kill(tmp_path, ray_cluster):
    """Not bitwise (a max difference of about 4e-8 after 12 steps): the replicas' all-reduce
    adds the micro-batches' gradients in another order than Lightning's accumulation."""
    spec = adapter.spec_from_lightning(LitMLP, datamodule=BlobData, global_batch_size=G,
                                       micro_batch_size=M)
    job = planaria.Job(spec, RunConfig(steps=STEPS, replicas=3, run_dir=tmp_path, ledger=True),
                       chaos=planaria.ChaosPlan.parse("kill:w1@step4"))
    with job:
        drive(job, STEPS, wait_width_at=STEPS - 3)
        state = job.model_state_dict()
    assert job.steps_done == STEPS
    assert_the_reference_training(state, trainer_reference, STEPS)
    assert_exactly_once(tmp_path, num_samples=N, global_batch_size=G, steps=STEPS)
    evs = events(tmp_path)
    assert_one_kill_healed_by_a_transfer(evs)
    # self.log / self.log_dict reached the step's metrics: the global batch's mean
    committed = of(evs, "step_committed")
    assert [e["step"] for e in committed][-1] == STEPS - 1
    for e in committed:
        assert set(e["metrics"]) == {"train_loss", "train_acc"}
        assert e["metrics"]["train_loss"] == pytest.approx(e["loss"], rel=1e-5)
        assert 0.0 <= e["metrics"]["train_acc"] <= 1.0


def initial_state(seed: int = 0) -> dict[str, torch.Tensor]:
    """The module as planaria's workers build it (the generators seeded from the seed)."""
    seed_globals(factory_seed(seed, "model"))
    return LitMLP().state_dict()


def lightning_validate(state: dict[str, torch.Tensor]) -> dict[str, float]:
    """A one-device Lightning Trainer's validate of ``state`` on the val loader: each
    logged value's epoch mean."""
    module = LitMLP()
    module.load_state_dict(state)
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False)
    (figures,) = trainer.validate(module, dataloaders=val_loader(), verbose=False)
    return figures


def assert_lightnings(figures: dict[str, float], lightning: dict[str, float]) -> None:
    """Equal to float32 rounding: Lightning sums its epoch means in float32, planaria in
    float64."""
    assert figures.keys() == lightning.keys() == {"val_loss", "val_acc"}
    torch.testing.assert_close({k: torch.tensor(v, dtype=torch.float32)
                                for k, v in figures.items()},
                               {k: torch.tensor(v, dtype=torch.float32)
                                for k, v in lightning.items()})


@pytest.mark.multiprocess
@pytest.mark.slow
def test_validation_at_3_replicas_is_lightnings_and_the_same_at_1(tmp_path, ray_cluster):
    """validation_step over val_dataloader() (7 batches of its batch_size 8, the last of 2,
    by its own collate_fn), every 4 steps: the figures of a Trainer's validate of the same
    weights, at step 0 and at the end; and the same figures at 1 replica."""
    steps, every = 8, 4
    spec = adapter.spec_from_lightning(LitMLP, datamodule=ValBlobData, global_batch_size=G,
                                       micro_batch_size=M)
    assert spec.eval_batch_size == VAL_BS
    job = planaria.Job(spec, RunConfig(steps=steps, replicas=3, run_dir=tmp_path / "three",
                                       eval_every=every))
    with job:
        first = job.evaluate()
        run_with_evals(job, steps)
        state = job.model_state_dict()
        evals = [e for e in job.evaluation.results if e.step]
    assert (first.step, first.samples) == (0, VAL_N)
    assert_lightnings(first.metrics, lightning_validate(initial_state()))
    assert [(e.step, e.samples) for e in evals] == [(4, VAL_N), (8, VAL_N)]
    assert_lightnings(evals[-1].metrics, lightning_validate(state))
    assert [e["step"] for e in of(events(tmp_path / "three"), "eval")] == [0, 4, 8]
    one = adapter.fit_lightning(LitMLP, datamodule=ValBlobData, global_batch_size=G,
                                micro_batch_size=M, steps=steps, replicas=1,
                                run_dir=tmp_path / "one", eval_every=every)
    assert [(e.step, e.samples) for e in one.evals] == [(e.step, e.samples) for e in evals]
    for at_one, at_three in zip(one.evals, evals, strict=True):
        torch.testing.assert_close(at_one.metrics, at_three.metrics, atol=1e-6, rtol=1e-5)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_fit_lightning_returns_fits_result_with_the_metrics(tmp_path, ray_cluster):
    """The convenience, with a dataset (no datamodule) and a StepLR per step."""
    seen: list[dict[str, float]] = []
    result = adapter.fit_lightning(
        lambda: LitMLP(scheduler="step"), train_dataset=Blobs, global_batch_size=G,
        micro_batch_size=M, steps=4, replicas=2, run_dir=tmp_path,
        on_step=lambda r: seen.append(r.metrics))
    assert result.final_step == 4 and len(result.losses) == 4
    assert set(result.state_dict) == set(LitMLP().state_dict())
    assert len(seen) == 4 and all(set(m) == {"train_loss", "train_acc"} for m in seen)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_manual_optimization_is_refused_from_the_workers(tmp_path, ray_cluster):
    with pytest.raises(UserCodeError, match=r"manual optimization \(automatic_optimization"):
        adapter.fit_lightning(ManualMLP, datamodule=BlobData, global_batch_size=G,
                              micro_batch_size=M, steps=2, replicas=1, run_dir=tmp_path)


# ---- the parts, in this process -------------------------------------------------------------

def test_the_specs_parts_map_a_module_and_a_datamodule(caplog):
    spec = adapter.spec_from_lightning(LitMLP, datamodule=BlobData, global_batch_size=G,
                                       micro_batch_size=M)
    assert spec.optimizer_gets == "model"
    with caplog.at_level("WARNING", logger="planaria.integrations.lightning"):
        module = spec.model()
        dataset = spec.dataset()
    assert "LitMLP.validation_step is not run: no eval set" in caplog.text
    assert "batch_size=7" in caplog.text and "RandomSampler" in caplog.text
    assert isinstance(dataset, Blobs)
    optimizer = spec.optimizer(module)
    scheduler = spec.lr_scheduler(optimizer)
    assert isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR)
    assert scheduler.optimizer is optimizer
    batch = spec.collate([dataset[i] for i in range(M)])
    loss, metrics = spec.loss(module, batch)
    assert loss.requires_grad and set(metrics) == {"train_loss", "train_acc"}
    assert metrics["train_loss"] == pytest.approx(float(loss.detach()))


def test_validation_figures_in_one_process_are_a_trainers_validate():
    """The spec's evaluation run here as a replica runs it (eval mode, no_grad, batches by
    index, the val loader's collate_fn), combined as the controller does: a Trainer's
    validate of the same weights, the shorter last batch weighted by its samples."""
    from planaria.control.evaluation import combine
    from planaria.wire.evaluation import EvalBatch

    spec = adapter.spec_from_lightning(LitMLP, datamodule=ValBlobData, global_batch_size=G,
                                       micro_batch_size=M)
    assert spec.eval_batch_size == VAL_BS and isinstance(spec.evaluate, adapter.ValidationStep)
    seed_globals(factory_seed(0, "model"))
    module = spec.model()
    spec.dataset()
    data = spec.eval_dataset()
    assert len(data) == VAL_N and spec.eval_collate.__self__.val_collate_fn is val_collate
    module.eval()
    batches = []
    with torch.no_grad():
        for j, start in enumerate(range(0, VAL_N, VAL_BS)):
            ids = range(start, min(start + VAL_BS, VAL_N))
            batch = spec.eval_collate([data[i] for i in ids])
            batches.append(EvalBatch(index=j, samples=len(ids),
                                     metrics=spec.evaluate(module, batch)))
    assert batches[-1].samples == 2
    assert_lightnings(combine(batches), lightning_validate(module.state_dict()))


def test_the_eval_set_from_val_dataset_or_none():
    spec = adapter.spec_from_lightning(LitMLP, train_dataset=Blobs, val_dataset=val_set,
                                       global_batch_size=G, micro_batch_size=M)
    assert isinstance(spec.eval_dataset(), Blobs) and len(spec.eval_dataset()) == VAL_N
    assert spec.eval_batch_size is None and spec.eval_collate is None  # the training's
    given = adapter.spec_from_lightning(LitMLP, datamodule=ValBlobData, eval_batch_size=5,
                                        global_batch_size=G, micro_batch_size=M)
    assert given.eval_batch_size == 5
    plain = adapter.spec_from_lightning(LitMLP, datamodule=BlobData, global_batch_size=G,
                                        micro_batch_size=M)
    assert plain.eval_dataset is None and plain.evaluate is None


class NoValidation(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(DIM, CLASSES)

    def training_step(self, batch, batch_idx):
        return nn.functional.cross_entropy(self.net(batch[0]), batch[1])


def test_an_eval_set_without_validation_step_is_not_used(caplog):
    with caplog.at_level("WARNING", logger="planaria.integrations.lightning"):
        spec = adapter.spec_from_lightning(NoValidation, datamodule=ValBlobData,
                                           global_batch_size=G, micro_batch_size=M)
    assert spec.eval_dataset is None
    assert "NoValidation has no validation_step: the eval set is not used" in caplog.text
    # a function factory is not built here: the evaluations run, with no figures
    spec = adapter.spec_from_lightning(lambda: NoValidation(), datamodule=ValBlobData,
                                       global_batch_size=G, micro_batch_size=M)
    assert spec.eval_dataset is not None
    with caplog.at_level("WARNING", logger="planaria.integrations.lightning"):
        module = spec.model()
    assert "NoValidation has no validation_step: its evaluations have no figures" in caplog.text
    assert spec.evaluate(module, val_collate([val_set()[0]])) == {}


def test_training_step_outputs():
    module = adapter.LightningModel(LitMLP)()
    step = adapter.TrainingStep()
    module.training_step = lambda batch, i: {"loss": torch.tensor(2.0), "extra": 1}
    assert float(step(module, None)[0]) == 2.0
    module.training_step = lambda batch, i: None
    with pytest.raises(ValueError, match="returned NoneType: planaria needs a loss tensor"):
        step(module, None)
    with pytest.raises(ValueError, match="without 'loss'"):
        module.training_step = lambda batch, i: {"out": torch.tensor(1.0)}
        step(module, None)
    with pytest.raises(ConfigError, match="module built by LightningModel"):
        step(LitMLP(), None)


def _conf(kind: str):
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    return {
        "optimizer": opt,
        "list": [opt],
        "lists": ([opt], [{"scheduler": sched, "interval": "step"}]),
        "dict": {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}},
        "bare scheduler": {"optimizer": opt, "lr_scheduler": sched},
        "epoch": ([opt], [{"scheduler": sched, "interval": "epoch"}]),
        "frequency": {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step",
                                                         "frequency": 2}},
        "two optimizers": [opt, torch.optim.Adam(model.parameters())],
        "two dicts": ({"optimizer": opt}, {"optimizer": torch.optim.Adam(model.parameters())}),
        "plateau": {"optimizer": opt, "lr_scheduler": {
            "scheduler": torch.optim.lr_scheduler.ReduceLROnPlateau(opt), "interval": "step",
            "monitor": "val_loss"}},
        "none": None,
    }[kind], opt, sched


@pytest.mark.parametrize("kind", ["optimizer", "list", "lists", "dict"])
def test_configure_optimizers_forms_that_map(kind):
    conf, opt, sched = _conf(kind)
    optimizer, scheduler = adapter.optimization_of(conf)
    assert optimizer is opt
    assert scheduler is (sched if kind in ("lists", "dict") else None)


@pytest.mark.parametrize(("kind", "refusal"), [
    ("bare scheduler", r"interval='epoch' is refused \(it is Lightning's default"),
    ("epoch", "interval='epoch' is refused"),
    ("frequency", "frequency=2 is refused"),
    ("two optimizers", "returned 2 optimizers: planaria trains with one"),
    ("two dicts", "returned 2 optimizers"),
    ("plateau", "reduce_on_plateau"),
    ("none", "returned None"),
])
def test_configure_optimizers_refusals_by_name(kind, refusal):
    with pytest.raises(ConfigError, match=refusal):
        adapter.optimization_of(_conf(kind)[0])


def test_manual_optimization_is_refused():
    with pytest.raises(ConfigError, match=r"manual optimization \(automatic_optimization=False"
                                          r"\) is refused"):
        adapter.check_module(ManualMLP())
    with pytest.raises(ConfigError, match="must return a LightningModule"):
        adapter.check_module(nn.Linear(2, 2))


def test_what_the_spec_refuses():
    with pytest.raises(ConfigError, match="give a factory"):
        adapter.spec_from_lightning(LitMLP(), train_dataset=Blobs, global_batch_size=G,
                                    micro_batch_size=M)
    with pytest.raises(ConfigError, match="val_dataset is not valid with a datamodule"):
        adapter.spec_from_lightning(LitMLP, datamodule=BlobData, val_dataset=Blobs,
                                    global_batch_size=G, micro_batch_size=M)
    with pytest.raises(ConfigError, match=r"eval_every=0.25 is refused: a float is "
                                          "Lightning's val_check_interval as a fraction"):
        adapter.fit_lightning(LitMLP, datamodule=ValBlobData, global_batch_size=G,
                              micro_batch_size=M, steps=2, replicas=1, run_dir="unused",
                              eval_every=0.25)
    with pytest.raises(ConfigError, match="give exactly one"):
        adapter.spec_from_lightning(LitMLP, global_batch_size=G, micro_batch_size=M)


class Stream(IterableDataset):
    def __iter__(self):
        yield from range(4)


class StreamData(pl.LightningDataModule):
    def train_dataloader(self) -> DataLoader:
        return DataLoader(Stream(), batch_size=2)


def test_an_iterable_dataset_is_refused_with_the_way():
    spec = adapter.spec_from_lightning(LitMLP, datamodule=StreamData, global_batch_size=G,
                                       micro_batch_size=M)
    with pytest.raises(ConfigError, match=r"not a map-style dataset.*exactly-once"):
        spec.dataset()


def test_without_lightning_the_import_error_says_how_to_install(monkeypatch):
    for name in ("lightning", "lightning.pytorch", "pytorch_lightning"):
        monkeypatch.setitem(sys.modules, name, None)  # import raises ImportError
    monkeypatch.delitem(sys.modules, "planaria.integrations.lightning")
    with pytest.raises(ImportError, match=r'pip install "planaria\[lightning\]"'):
        importlib.import_module("planaria.integrations.lightning")
    monkeypatch.undo()
    assert pl.LightningModule in importlib.import_module(
        "planaria.integrations.lightning").MODULE_BASES


def test_import_planaria_does_not_import_lightning():
    import subprocess

    code = ("import sys, planaria; bad = [m for m in ('pytorch_lightning', 'lightning', "
            "'planaria.integrations.lightning') if m in sys.modules]; print(bad); "
            "sys.exit(bool(bad))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.multiprocess
@pytest.mark.slow
def test_the_example_runs_with_a_kill(tmp_path, ray_cluster, capsys):
    """examples/lightning_module.py (planaria.examples.lightning_module) as the README runs
    it, shorter."""
    from planaria.examples import lightning_module as example

    metrics = example.main(["--replicas", "2", "--steps", "6", "--chaos", "kill:w1@step2",
                            "--run-dir", str(tmp_path)])
    assert set(metrics) == {"train_loss", "train_acc"}
    assert "trained 6 steps" in capsys.readouterr().out
    assert [f["kind"] for f in of(events(tmp_path), "fault")] == ["worker_lost"]
