"""``ElasticTrainer``: Hugging Face ``Trainer``'s arguments trained by planaria.

The target: at 3 replicas with a kill it ends with the weights of ``transformers.Trainer``
run alone in one process on planaria's sample order (fed through its sampler), the same
arguments and seeds. A tiny GPT-2 built from a config (nothing downloaded), fixed-length
sequences (no padding).
"""

from __future__ import annotations

import pickle
import re
import subprocess
import sys
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import (  # noqa: E402
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from planaria import ConfigError  # noqa: E402
from planaria.data.plan import DataPlan  # noqa: E402
from planaria.integrations.transformers import ElasticTrainer, plan_training  # noqa: E402
from planaria.integrations.transformers.factories import (  # noqa: E402
    AdamWFactory,
    ModelFromWeights,
)
from tests.assertions import events, of  # noqa: E402

VOCAB, LENGTH, N = 97, 16, 96
MICRO, STEPS, SEED = 4, 8, 3
EVAL_SAMPLES, EVAL_BATCH = 10, 3  # a shorter last batch


def token_rows(n: int = N) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n, LENGTH), generator=torch.Generator().manual_seed(0))


def samples() -> list[dict[str, torch.Tensor | int]]:
    """A map-style dataset of dict samples; ``row`` is a column the model does not take
    (dropped, as Trainer drops it)."""
    return [{"input_ids": r, "labels": r.clone(), "row": i} for i, r in enumerate(token_rows())]


def tiny_gpt2(dropout: float = 0.0) -> GPT2LMHeadModel:
    torch.manual_seed(1)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32,
                        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
                        bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


def arguments(output_dir, **overrides) -> TrainingArguments:
    fields = dict(output_dir=str(output_dir), per_device_train_batch_size=MICRO,
                  gradient_accumulation_steps=2, max_steps=STEPS, learning_rate=1e-3,
                  weight_decay=0.1, warmup_steps=2, lr_scheduler_type="cosine",
                  max_grad_norm=0.5, seed=SEED, logging_steps=2, save_strategy="no",
                  report_to="none", use_cpu=True, disable_tqdm=True)
    fields.update(overrides)
    return TrainingArguments(**fields)


@dataclass
class Recorder(TrainerCallback):
    """The hooks a callback received, with ``state.global_step`` at each."""

    calls: list[tuple[str, int]] = field(default_factory=list)
    logs: list[tuple[int, dict]] = field(default_factory=list)
    evals: list[tuple[int, dict]] = field(default_factory=list)

    def on_train_begin(self, args, state, control, **kwargs):
        self.calls.append(("on_train_begin", state.global_step))

    def on_step_end(self, args, state, control, **kwargs):
        self.calls.append(("on_step_end", state.global_step))

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.calls.append(("on_log", state.global_step))
        self.logs.append((state.global_step, dict(logs)))

    def on_save(self, args, state, control, **kwargs):
        self.calls.append(("on_save", state.global_step))

    def on_train_end(self, args, state, control, **kwargs):
        self.calls.append(("on_train_end", state.global_step))

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        self.calls.append(("on_evaluate", state.global_step))
        self.evals.append((state.global_step, dict(metrics)))

    def steps(self, hook: str) -> list[int]:
        return [step for name, step in self.calls if name == hook]


def assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], msg=lambda m, k=key: f"{k}: {m}")


# ---- the target: equal to Trainer alone, at 3 replicas with a kill -----------------------

class PlannedOrder(torch.utils.data.Sampler):
    def __init__(self, order: np.ndarray) -> None:
        self.order = [int(i) for i in order]

    def __iter__(self):
        return iter(self.order)

    def __len__(self) -> int:
        return len(self.order)


def trainer_alone(output_dir, *, global_batch: int, **overrides) -> dict[str, torch.Tensor]:
    """``transformers.Trainer`` in this process, fed planaria's sample order (its data plan's
    global batches, in order) through its sampler; one device, so its gradient accumulation
    covers the whole global batch."""
    plan = DataPlan(N, global_batch, SEED)
    order = np.concatenate([plan.batch(step) for step in range(STEPS)])

    class InPlanariasOrder(Trainer):
        def _get_train_sampler(self, *args, **kwargs):
            return PlannedOrder(order)

    model = tiny_gpt2()
    # Trainer divides a causal LM's summed loss by the labelled tokens it counts. It counts
    # labels[..., 1:] (the tokens the shifted loss has) only for a model whose loss_type is
    # ForCausalLM; GPT2LMHeadModel's is None (its class name does not match), so Trainer
    # would count every label, T per sequence, and scale the gradient by (T-1)/T. Naming the
    # loss type gives the token mean, which is the model's own loss (planaria's).
    model.loss_type = "ForCausalLM"
    args = arguments(output_dir, gradient_accumulation_steps=global_batch // MICRO, **overrides)
    InPlanariasOrder(model=model, args=args, train_dataset=samples()).train()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_trainers_gradient_is_the_mean_of_the_micro_batches_losses(tmp_path):
    """What the equality rests on, seen without Adam (which hides a gradient's scale): one
    SGD step of Trainer at lr 1 moves the weights by its gradient, which equals planaria's,
    the micro-batches' own losses (model(**batch).loss, token means) each scaled by its share
    of the global batch: with equal-length unpadded sequences, Trainer's token-weighted mean
    over the gradient accumulation (num_items_in_batch) is that mean of means."""
    from transformers import default_data_collator

    from planaria.integrations.transformers.factories import model_loss

    data = samples()[: 2 * MICRO]
    model = tiny_gpt2()
    model.loss_type = "ForCausalLM"  # Trainer counts the shifted labels (see trainer_alone)
    before = {k: v.detach().clone() for k, v in model.named_parameters()}

    class InOrder(Trainer):
        def _get_train_sampler(self, *args, **kwargs):
            return PlannedOrder(np.arange(2 * MICRO))

    args = arguments(tmp_path, optim="sgd", learning_rate=1.0, lr_scheduler_type="constant",
                     warmup_steps=0, max_grad_norm=0.0, weight_decay=0.0, max_steps=1)
    InOrder(model=model, args=args, train_dataset=data).train()

    ours = tiny_gpt2()
    for j in range(2):
        batch = default_data_collator([{k: s[k] for k in ("input_ids", "labels")}
                                       for s in data[j * MICRO:(j + 1) * MICRO]])
        (model_loss(ours, batch) * (MICRO / (2 * MICRO))).backward()
    for name, p in ours.named_parameters():
        torch.testing.assert_close(before[name] - dict(model.named_parameters())[name], p.grad,
                                   msg=lambda m, k=name: f"{k}: {m}")


@pytest.fixture(scope="module")
def three_with_a_kill(tmp_path_factory, ray_cluster):
    """ElasticTrainer at 3 replicas, w1 killed while step 3 runs, checkpoints and an
    evaluation every 4 steps, a callback recording its hooks."""
    out = tmp_path_factory.mktemp("elastic")
    recorder = Recorder()
    args = arguments(out, save_strategy="steps", save_steps=4, eval_strategy="steps",
                     eval_steps=4, per_device_eval_batch_size=EVAL_BATCH,
                     report_to="tensorboard")
    trainer = ElasticTrainer(tiny_gpt2(), args, train_dataset=samples(),
                             eval_dataset=samples()[:EVAL_SAMPLES], callbacks=[recorder],
                             replicas=3, chaos="kill:w1@step3")
    output = trainer.train()
    return trainer, output, recorder, out


@pytest.mark.multiprocess
@pytest.mark.slow
def test_three_replicas_with_a_kill_end_with_trainers_weights(three_with_a_kill, tmp_path):
    trainer, output, _, _ = three_with_a_kill
    assert output.global_step == STEPS
    assert trainer.plan.global_batch_size == MICRO * 2 * 3
    faults = of(events(trainer.run_dir), "fault")
    assert [f["kind"] for f in faults] == ["worker_lost"]
    alone = trainer_alone(tmp_path, global_batch=trainer.plan.global_batch_size)
    assert_same_weights(alone, trainer.result.state_dict)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_callbacks_hear_the_steps_logs_and_saves(three_with_a_kill):
    trainer, _, recorder, _ = three_with_a_kill
    assert recorder.calls[0] == ("on_train_begin", 0)
    assert recorder.calls[-1] == ("on_train_end", STEPS)
    assert recorder.steps("on_step_end") == list(range(1, STEPS + 1))
    assert recorder.steps("on_log") == [2, 4, 4, 6, 8, 8]  # the evaluations' logs too
    assert recorder.steps("on_save") == [4, 8]
    assert recorder.steps("on_evaluate") == [4, 8]
    losses = dict(trainer.result.losses)
    rates = trainer.plan.scheduler.learning_rates(1e-3, STEPS)
    for step, logs in [(s, g) for s, g in recorder.logs if "eval_loss" not in g]:
        assert set(logs) == {"loss", "learning_rate", "epoch"}
        assert logs["loss"] == pytest.approx((losses[step - 2] + losses[step - 1]) / 2)
        assert logs["learning_rate"] == pytest.approx(rates[step - 1])
        assert logs["epoch"] == pytest.approx(step * trainer.plan.global_batch_size / N)
    assert rates[0] == 0.0 and max(rates) == pytest.approx(1e-3)  # warm-up, then cosine


@pytest.mark.multiprocess
@pytest.mark.slow
def test_the_evaluation_equals_trainers_evaluate_of_the_same_weights(three_with_a_kill,
                                                                    tmp_path):
    trainer, _, recorder, _ = three_with_a_kill
    (final,) = [m for step, m in recorder.evals if step == STEPS]
    model = tiny_gpt2()
    model.load_state_dict(trainer.result.state_dict)
    model.loss_type = "ForCausalLM"  # Trainer counts the shifted labels (see trainer_alone)
    alone = Trainer(model=model, args=arguments(tmp_path, per_device_eval_batch_size=EVAL_BATCH),
                    eval_dataset=samples()[:EVAL_SAMPLES])
    expected = alone.evaluate()["eval_loss"]
    assert final["eval_loss"] == pytest.approx(expected, rel=1e-5)
    assert [e.step for e in trainer.result.evals] == [4, 8]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_report_to_feeds_planarias_tracker(three_with_a_kill):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    trainer, _, _, _ = three_with_a_kill
    trackers = trainer.run_dir / "trackers"
    (folder,) = {p.parent for p in trackers.rglob("events.out.tfevents.*")}
    scalars = EventAccumulator(str(folder)).Reload()
    losses = [e.value for e in scalars.Scalars("train/loss")]
    assert losses == pytest.approx([loss for _, loss in trainer.result.losses])


@pytest.mark.multiprocess
@pytest.mark.slow
def test_the_saved_model_loads_with_from_pretrained(three_with_a_kill):
    trainer, _, _, out = three_with_a_kill
    loaded = GPT2LMHeadModel.from_pretrained(out)
    assert_same_weights(trainer.result.state_dict, loaded.state_dict())


# ---- dropout on: equal across widths and with a kill -------------------------------------

def text_dataset():
    """A ``datasets.Dataset`` (Arrow) with a column the model does not take."""
    datasets = pytest.importorskip("datasets")
    rows = token_rows().tolist()
    return datasets.Dataset.from_dict({"input_ids": rows, "labels": rows,
                                       "text": [f"row {i}" for i in range(N)]})


@pytest.mark.multiprocess
@pytest.mark.slow
def test_dropout_equal_at_one_and_three_replicas_with_a_kill(tmp_path, ray_cluster):
    one = ElasticTrainer(tiny_gpt2(dropout=0.1), arguments(tmp_path / "one",
                                                           gradient_accumulation_steps=6),
                         train_dataset=text_dataset(), replicas=1)
    one.train()
    three = ElasticTrainer(tiny_gpt2(dropout=0.1), arguments(tmp_path / "three"),
                           train_dataset=text_dataset(), replicas=3, chaos="kill:w2@step4")
    three.train()
    assert one.plan.global_batch_size == three.plan.global_batch_size == 24
    assert one.train_dataset.column_names == ["input_ids", "labels"]
    assert [f["kind"] for f in of(events(three.run_dir), "fault")] == ["worker_lost"]
    assert_same_weights(one.result.state_dict, three.result.state_dict)
    torch.testing.assert_close(torch.tensor(one.result.losses), torch.tensor(three.result.losses))


# ---- the mapping and the refusals, by name ------------------------------------------------

def test_arguments_map_to_the_plan(tmp_path):
    plan = plan_training(arguments(tmp_path, max_steps=-1, num_train_epochs=2.5, warmup_steps=0.25,
                                   max_grad_norm=0.0, logging_steps=0.5, save_strategy="steps",
                                   save_steps=3, save_total_limit=2, optim="adamw_torch"),
                         replicas=3, num_samples=N)
    assert (plan.global_batch_size, plan.micro_batch_size) == (24, MICRO)
    assert plan.steps == 10  # ceil(2.5 x 96 / 24)
    assert plan.scheduler.warmup_steps == 3 and plan.scheduler.training_steps == 10
    assert plan.grad_clip_norm is None and plan.logging_steps == 5
    assert plan.optimizer == AdamWFactory(lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                                          weight_decay=0.1, fused=False)
    checkpoint = plan.checkpoint()
    assert checkpoint is not None and (checkpoint.every, checkpoint.keep_last) == (3, 2)
    assert plan_training(arguments(tmp_path, bf16=True), replicas=1, num_samples=N).precision \
        == "bf16"


def test_the_optimizer_has_trainers_groups(tmp_path):
    model = tiny_gpt2()
    ours = AdamWFactory(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)(model)
    theirs = Trainer(model=model, args=arguments(tmp_path)).create_optimizer()
    assert [[id(p) for p in g["params"]] for g in ours.param_groups] == \
        [[id(p) for p in g["params"]] for g in theirs.param_groups]
    assert [g["weight_decay"] for g in ours.param_groups] == [0.1, 0.0]


def test_the_model_factory_rebuilds_the_given_weights():
    model = tiny_gpt2()
    factory = pickle.loads(pickle.dumps(ModelFromWeights.capture(model, use_cache=False)))
    rebuilt = factory()
    assert_same_weights(model.state_dict(), rebuilt.state_dict())
    assert rebuilt.config.use_cache is False


def test_model_init_builds_the_workers_model(tmp_path):
    trainer = ElasticTrainer(model_init=tiny_gpt2, args=arguments(tmp_path),
                             train_dataset=samples(), replicas=2)
    factory = pickle.loads(pickle.dumps(trainer.spec().model))
    assert_same_weights(tiny_gpt2().state_dict(), factory().state_dict())


class SavedTokenizer:
    def __init__(self) -> None:
        self.saved_to: list[str] = []

    def save_pretrained(self, where) -> None:
        self.saved_to.append(str(where))


def test_the_final_save_writes_the_model_and_the_processing_class(tmp_path):
    tokenizer = SavedTokenizer()
    trainer = ElasticTrainer(tiny_gpt2(), arguments(tmp_path), train_dataset=samples(),
                             processing_class=tokenizer, replicas=1)
    trainer.save_model()
    assert tokenizer.saved_to == [str(tmp_path)]
    loaded = GPT2LMHeadModel.from_pretrained(tmp_path)
    assert_same_weights(trainer.model.state_dict(), loaded.state_dict())


@pytest.mark.parametrize(("overrides", "named"), [
    ({"optim": "adafactor"}, "optim='adafactor'"),
    ({"report_to": "comet_ml"}, "report_to="),
    ({"label_smoothing_factor": 0.1}, "label_smoothing_factor=0.1"),
    ({"dataloader_drop_last": True}, "dataloader_drop_last=True"),
    ({"save_strategy": "epoch"}, "save_strategy='epoch'"),
    ({"eval_strategy": "epoch"}, "compute_metrics is not valid"),
    ({"load_best_model_at_end": True, "eval_strategy": "steps", "save_strategy": "steps"},
     "load_best_model_at_end=True"),
])
def test_refused_by_name(tmp_path, overrides, named):
    with pytest.raises(ConfigError, match=re.escape(named)):
        ElasticTrainer(tiny_gpt2(), arguments(tmp_path, **overrides), train_dataset=samples(),
                       eval_dataset=samples(), compute_metrics=lambda p: {}, replicas=2)


def test_a_field_no_table_knows_is_refused(tmp_path):
    """A field a later transformers adds is refused until it is placed in a table."""

    @dataclass
    class NewerArguments(TrainingArguments):
        brand_new_option: int = 0

    args = NewerArguments(output_dir=str(tmp_path), brand_new_option=1, report_to="none")
    with pytest.raises(ConfigError, match=r"brand_new_option=1 .*does not honour it"):
        plan_training(args, replicas=1, num_samples=N)
    plan_training(NewerArguments(output_dir=str(tmp_path), report_to="none"), replicas=1,
                  num_samples=N)  # at its default it is no question


def test_trainer_arguments_refused_by_name(tmp_path):
    model = tiny_gpt2()
    with pytest.raises(ConfigError, match="optimizers="):
        ElasticTrainer(model, arguments(tmp_path), train_dataset=samples(), replicas=1,
                       optimizers=(torch.optim.SGD(model.parameters(), lr=0.1), None))
    with pytest.raises(ConfigError, match="compute_loss_func"):
        ElasticTrainer(model, arguments(tmp_path), train_dataset=samples(), replicas=1,
                       compute_loss_func=lambda outputs, labels, num_items_in_batch: 0)
    with pytest.raises(ConfigError, match="map-style"):
        ElasticTrainer(model, arguments(tmp_path), train_dataset=iter(samples()), replicas=1)


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=False)


@pytest.mark.slow  # a fresh interpreter imports torch
def test_without_transformers_the_import_error_says_what_to_install():
    done = _python("import sys; sys.modules['transformers'] = None\n"
                   "import planaria.integrations.transformers")
    assert done.returncode != 0
    assert 'pip install "planaria[hf]"' in done.stderr


@pytest.mark.slow  # a fresh interpreter imports torch
def test_import_planaria_does_not_import_transformers():
    done = _python("import sys, planaria; print('transformers' in sys.modules)")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


@pytest.mark.multiprocess
@pytest.mark.slow
def test_the_example_runs_with_a_kill(tmp_path, ray_cluster):
    from planaria.examples import hf_causal_lm

    trainer = hf_causal_lm.main(["--replicas", "2", "--steps", "4", "--chaos", "kill:w1@step2",
                                 "--output-dir", str(tmp_path)])
    assert trainer.result.final_step == 4
    assert trainer.train_dataset.column_names == ["input_ids", "labels"]
    loaded = GPT2LMHeadModel.from_pretrained(tmp_path)
    assert_same_weights(trainer.result.state_dict, loaded.state_dict())
