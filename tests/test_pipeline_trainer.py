"""PipelineTrainer against a plain transformers Trainer on the same data and seed: tiny LLaMA
and GPT-2 (its head tied to the embedding) in one process (2 CPU cells), at pp=2 and at pp2 x
dp2; the logged losses, the grad norms, the eval loss and the trained weights agree (float32
rounding, float64 to 1e-12 where Trainer allows); checkpoints resume with the same losses, at
the same and at another layout; save_model writes what from_pretrained loads; what Trainer
options the pipe cannot take are refused by name."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import trainer_cases as cases
from cluster import Cluster, values

MODELS = ["llama", "gpt2"]
FLOAT32 = 2e-5  # float32 rounding over a few AdamW steps at lr 1e-2 (weights ~0.1)


def close(a: dict[Any, float], b: dict[Any, float], rel: float) -> bool:
    return a.keys() == b.keys() and all(math.isclose(a[k], b[k], rel_tol=rel) for k in a)


def assert_weights(state: dict[str, torch.Tensor], reference: dict[str, torch.Tensor],
                   atol: float) -> None:  # fmt: skip
    assert state, "no weights"
    for key, tensor in state.items():
        torch.testing.assert_close(tensor, reference[key], rtol=0, atol=atol, msg=key)


class PlainRuns(dict):  # type: ignore[type-arg]
    """The plain Trainer's run per (model, rows per batch, rows of data), made when first
    asked for."""

    def __init__(self, folder: Path) -> None:
        super().__init__()
        self.folder = folder

    def __missing__(self, key: tuple[str, int, int]) -> Any:
        family, batch, rows = key
        folder = str(self.folder / f"{family}-{batch}-{rows}")
        self[key] = cases.plain(family, folder, batch=batch, rows=rows)
        return self[key]


@pytest.fixture(scope="module")
def plain_runs(tmp_path_factory: pytest.TempPathFactory) -> PlainRuns:
    return PlainRuns(tmp_path_factory.mktemp("plain"))


def assert_equals_plain(run: dict[str, Any], reference: dict[str, Any]) -> None:
    assert sorted(run["losses"]) == list(range(1, cases.STEPS + 1))
    assert close(run["losses"], reference["losses"], 1e-6), (run["losses"], reference["losses"])
    assert close(run["grad_norms"], reference["grad_norms"], 1e-5)
    assert math.isclose(run["eval_loss"], reference["eval_loss"], rel_tol=1e-6)
    assert_weights(run["state"], reference["state"], FLOAT32)


@pytest.mark.parametrize("name", MODELS)
def test_one_process_equals_the_plain_trainer(name: str, tmp_path: Path,
                                              plain_runs: dict[Any, Any]) -> None:  # fmt: skip
    run = cases.pipelined(name, str(tmp_path))
    assert run["split_points"] == (["model.layers.2"] if name == "llama" else ["transformer.h.2"])
    assert_equals_plain(run, plain_runs[name, 4, cases.ROWS])


def test_float64_is_exact(tmp_path: Path) -> None:
    # transformers' own loss computes in float32 whatever the model's dtype: a loss of the
    # model's dtype (compute_loss_func) makes float64 reach the logs. Trainer keeps its
    # running loss in the default dtype, float64 here.
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        reference = cases.plain("gpt2", str(tmp_path / "plain"), dtype=torch.float64,
                                loss=cases.causal_lm_loss)  # fmt: skip
        run = cases.pipelined("gpt2", str(tmp_path / "pipe"), dtype=torch.float64,
                              loss=cases.causal_lm_loss)  # fmt: skip
    finally:
        torch.set_default_dtype(previous)
    assert close(run["losses"], reference["losses"], 1e-12)
    assert close(run["grad_norms"], reference["grad_norms"], 1e-12)
    assert math.isclose(run["eval_loss"], reference["eval_loss"], rel_tol=1e-12)
    assert_weights(run["state"], reference["state"], 1e-12)


@pytest.mark.parametrize("name", MODELS)
def test_two_processes_equal_the_plain_trainer(name: str, two: Cluster, tmp_path: Path,
                                               plain_runs: dict[Any, Any]) -> None:  # fmt: skip
    ranks = values(two.run("trainer_cases.pipelined_rank", family=name, folder=str(tmp_path)))
    assert ranks[0]["losses"] == ranks[1]["losses"]  # every rank logs the same losses
    assert ranks[0]["eval_loss"] == ranks[1]["eval_loss"]
    state = ranks[0]["state"] | ranks[1]["state"]  # each rank holds its stages' tensors
    assert set(ranks[0]["state"]).isdisjoint(ranks[1]["state"]) or name == "gpt2"
    assert_equals_plain({**ranks[0], "state": state}, plain_runs[name, 4, cases.ROWS])


def test_pp2_by_dp2_equals_the_plain_trainer(four: Cluster, tmp_path: Path,
                                             plain_runs: dict[Any, Any]) -> None:  # fmt: skip
    # Each replica reads its own batches of 4: the plain Trainer's batches of 8, split (of
    # data that fills every batch: a short one would be evened out over the replicas).
    ranks = values(four.run("trainer_cases.pipelined_rank", family="gpt2", folder=str(tmp_path),
                            pp_size=2, rows=32))  # fmt: skip
    assert all(r["losses"] == ranks[0]["losses"] for r in ranks)
    assert_equals_plain({**ranks[0], "state": ranks[0]["state"] | ranks[1]["state"]},
                        plain_runs["gpt2", 8, 32])  # fmt: skip
    for replica in (ranks[2], ranks[3]):  # the second replica holds the same weights
        assert_weights(replica["state"], ranks[0]["state"] | ranks[1]["state"], 0.0)


def test_stages_sharded_over_the_replicas_equal_the_plain_trainer(
    four: Cluster, tmp_path: Path, plain_runs: PlainRuns
) -> None:
    # dp_shard: each stage's parameters, gradients and AdamW state in halves over the two
    # replicas (FSDP2); save_model gathers each tensor whole.
    ranks = values(four.run("trainer_cases.saved_then_loaded", family="gpt2", folder=str(tmp_path),
                            pp_size=2, rows=32, dp_shard=True))  # fmt: skip
    reference = plain_runs["gpt2", 8, 32]
    assert close(ranks[0]["losses"], reference["losses"], 1e-6)
    assert_weights(ranks[0]["loaded"], reference["state"], FLOAT32)


@pytest.fixture(scope="module")
def checkpointed(two: Cluster, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A pp=2 run of GPT-2 that saves a checkpoint every 2 steps: its folder and losses (on
    data that fills every batch, which replicas read alike)."""
    folder = tmp_path_factory.mktemp("checkpoints")
    ranks = values(two.run("trainer_cases.pipelined_rank", family="gpt2", folder=str(folder),
                           save_strategy="steps", save_steps=2, rows=32))  # fmt: skip
    return {"folder": folder, "run": ranks[0]}


def test_a_checkpoint_holds_a_model_directory_and_the_optimizer(checkpointed: Any) -> None:
    checkpoint = checkpointed["folder"] / "checkpoint-2"
    files = set(os.listdir(checkpoint))
    assert {"config.json", "model.safetensors.index.json", "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors", "optimizer", "scheduler.pt",
            "trainer_state.json", "rng_state_0.pth", "rng_state_1.pth"} <= files  # fmt: skip
    assert (checkpoint / "optimizer" / ".metadata").is_file()


def test_resuming_at_pp2_gives_the_same_losses(checkpointed: Any, two: Cluster,
                                               tmp_path: Path) -> None:  # fmt: skip
    resume = str(checkpointed["folder"] / "checkpoint-2")
    ranks = values(two.run("trainer_cases.pipelined_rank", family="gpt2", folder=str(tmp_path),
                           resume=resume, rows=32))  # fmt: skip
    assert ranks[0]["losses"] == checkpointed["run"]["losses"]  # steps 3 and 4 to the bit


def test_resuming_in_one_process_gives_the_same_losses(checkpointed: Any,
                                                       tmp_path: Path) -> None:  # fmt: skip
    # The pp=2 checkpoint, resharded into one process's two cells (the same micro-batches).
    resume = str(checkpointed["folder"] / "checkpoint-2")
    run = cases.pipelined("gpt2", str(tmp_path), resume=resume, rows=32)
    # The same sums, but the clipping norm's shares add up in another order.
    assert close(run["losses"], checkpointed["run"]["losses"], 1e-6)


def test_resuming_at_pp2_by_dp2_gives_the_same_losses(checkpointed: Any, four: Cluster,
                                                      tmp_path: Path) -> None:  # fmt: skip
    # Two replicas of 2 rows each read the batches of 4 the pp=2 run read.
    resume = str(checkpointed["folder"] / "checkpoint-2")
    ranks = values(four.run("trainer_cases.pipelined_rank", family="gpt2", folder=str(tmp_path),
                            resume=resume, pp_size=2, batch=2, rows=32))  # fmt: skip
    assert close(ranks[0]["losses"], checkpointed["run"]["losses"], 1e-6)


@pytest.mark.parametrize("name", MODELS)
def test_save_model_then_from_pretrained_gives_the_trained_weights(
    name: str, two: Cluster, tmp_path: Path
) -> None:
    ranks = values(two.run("trainer_cases.saved_then_loaded", family=name, folder=str(tmp_path)))
    trained = ranks[0]["state"] | ranks[1]["state"]
    loaded = ranks[0]["loaded"]
    assert set(loaded) == set(trained)
    assert_weights(trained, loaded, 0.0)  # safetensors holds the values as they were
    assert "model.safetensors.index.json" in ranks[0]["files"]
    assert "config.json" in ranks[0]["files"]
    if name == "gpt2":  # saved once, under the embedding's name; tied again on loading
        assert ranks[0]["tied"]


@pytest.mark.parametrize("loss", ["the model's own", "compute_loss_func"])
def test_padded_batches_count_tokens_as_the_plain_trainer(loss: str, tmp_path: Path) -> None:
    # Rows of 6 to 12 tokens, and the epoch's last batch short: Trainer divides each batch's
    # summed loss by the labels of the whole accumulated step (num_items_in_batch), so a
    # row weighs by its labels, in its micro-batch, batch and step.
    func = cases.causal_lm_loss if loss == "compute_loss_func" else None
    reference = cases.plain("llama", str(tmp_path / "plain"), padded=True, rows=30, loss=func)
    run = cases.pipelined("llama", str(tmp_path / "pipe"), padded=True, rows=30, loss=func)
    assert_equals_plain(run, reference)


def test_callbacks_see_every_step_and_the_progress_bar_runs(tmp_path: Path) -> None:
    from transformers import TrainerCallback
    from transformers.trainer_callback import ProgressCallback

    from gpipe_fast.integrations.transformers import PipelineTrainer

    class Counting(TrainerCallback):  # type: ignore[misc]
        def __init__(self) -> None:
            self.steps: list[int] = []
            self.logged: list[float] = []

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.steps.append(state.global_step)

        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **_: Any) -> None:
            if logs and "loss" in logs:
                self.logged.append(logs["loss"])

    counting = Counting()
    trainer = PipelineTrainer(model=cases.model("llama"),
                              args=cases.arguments(str(tmp_path), disable_tqdm=False),
                              train_dataset=cases.Windows(), callbacks=[counting])  # fmt: skip
    assert any(isinstance(c, ProgressCallback) for c in trainer.callback_handler.callbacks)
    trainer.train()
    trainer.pipe.close()
    assert counting.steps == [1, 2, 3, 4] and len(counting.logged) == 4


def test_predict_gives_the_plain_models_logits(tmp_path: Path) -> None:
    from transformers import Trainer

    from gpipe_fast.integrations.transformers import PipelineTrainer

    data = cases.Windows(12, seed=3)
    args = cases.arguments(str(tmp_path))
    expected = Trainer(model=cases.model("gpt2"), args=args).predict(data)
    trainer = PipelineTrainer(model=cases.model("gpt2"), args=args, eval_dataset=data, chunks=3)
    found = trainer.predict(data)
    trainer.pipe.close()
    assert found.predictions.shape == expected.predictions.shape == (12, cases.LENGTH, cases.VOCAB)
    assert abs(found.predictions - expected.predictions).max() < 1e-5
    assert (found.label_ids == expected.label_ids).all()
    assert math.isclose(found.metrics["test_loss"], expected.metrics["test_loss"], rel_tol=1e-6)


def test_predict_on_two_processes_gives_every_rank_the_logits(two: Cluster,
                                                              tmp_path: Path) -> None:  # fmt: skip
    from transformers import Trainer

    expected = Trainer(model=cases.model("llama"), args=cases.arguments(str(tmp_path))).predict(
        cases.Windows(12, seed=3)
    )
    ranks = values(two.run("trainer_cases.predicted_rank", family="llama", folder=str(tmp_path)))
    for rank in ranks:
        assert abs(rank["predictions"] - expected.predictions).max() < 1e-5
        assert math.isclose(rank["loss"], expected.metrics["test_loss"], rel_tol=1e-6)


def test_a_meta_model_takes_pretrained_weights_through_model_init(tmp_path: Path) -> None:
    from gpipe_fast.integrations.transformers import PipelineTrainer

    pretrained = cases.model("llama")
    pretrained.save_pretrained(tmp_path / "pretrained")
    trainer = PipelineTrainer(model_init=lambda: cases.model("llama", meta=True),
                              args=cases.arguments(str(tmp_path / "run"), max_steps=2),
                              train_dataset=cases.Windows(),
                              pretrained=tmp_path / "pretrained")  # fmt: skip
    first = trainer.pipe
    assert_weights(first.state_dict(), pretrained.state_dict(), 0.0)
    trainer.train()  # model_init builds the model again, and a new pipe reads the weights
    assert trainer.pipe is not first
    moved = trainer.pipe.state_dict()
    assert any(not torch.equal(moved[k], v) for k, v in pretrained.state_dict().items())
    trainer.pipe.close()


def refusals() -> list[Any]:
    return [
        pytest.param({"torch_compile": True}, "torch_compile", id="torch_compile"),
        pytest.param({"auto_find_batch_size": True}, "auto_find_batch_size", id="auto_batch"),
        pytest.param({"deepspeed": "ds_config.json"}, "DeepSpeed", id="deepspeed"),
        pytest.param({"fsdp": "full_shard"}, "dp_shard=True", id="fsdp"),
    ]


@pytest.mark.parametrize(("setting", "named"), refusals())
def test_what_would_wrap_the_model_another_way_is_refused(setting: dict[str, Any], named: str,
                                                          tmp_path: Path) -> None:  # fmt: skip
    from gpipe_fast.integrations.transformers import PipelineTrainer

    args = cases.arguments(str(tmp_path))
    for key, value in setting.items():  # set afterwards: TrainingArguments checks its own
        setattr(args, key, value)
    with pytest.raises(ValueError, match=named):
        PipelineTrainer(model=cases.model("llama"), args=args, train_dataset=cases.Windows())


def test_a_compute_loss_override_is_refused(tmp_path: Path) -> None:
    from gpipe_fast.integrations.transformers import PipelineTrainer

    class Custom(PipelineTrainer):  # type: ignore[misc]
        def compute_loss(self, *args: Any, **kwargs: Any) -> Any:
            return None

    with pytest.raises(TypeError, match="compute_loss_func"):
        Custom(model=cases.model("llama"), args=cases.arguments(str(tmp_path)),
               train_dataset=cases.Windows())  # fmt: skip


def test_pp_size_must_fit_the_job(tmp_path: Path) -> None:
    from gpipe_fast.integrations.transformers import PipelineTrainer

    with pytest.raises(ValueError, match="torchrun --nproc-per-node 2"):
        PipelineTrainer(model=cases.model("llama"), args=cases.arguments(str(tmp_path)),
                        train_dataset=cases.Windows(), pp_size=2)  # fmt: skip


def test_bf16_autocast_reaches_the_stages(tmp_path: Path) -> None:
    # Trainer's bf16 autocasts its model's forward; the pipe's stages run under the same
    # autocast (bfloat16 products: the two runs agree to bfloat16's rounding, not exactly).
    reference = cases.plain("llama", str(tmp_path / "plain"), bf16=True)
    run = cases.pipelined("llama", str(tmp_path / "pipe"), bf16=True)
    assert close(run["losses"], reference["losses"], 1e-3)
    assert run["losses"] != cases.pipelined("llama", str(tmp_path / "fp32"))["losses"]


def test_save_model_writes_the_tokenizer(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models
    from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

    from gpipe_fast.integrations.transformers import PipelineTrainer

    vocabulary = {f"w{i}": i for i in range(cases.VOCAB)}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocabulary, unk_token="w0")),
        unk_token="w0",
        pad_token="w0",
    )
    trainer = PipelineTrainer(
        model=cases.model("llama"), args=cases.arguments(str(tmp_path)),
        train_dataset=cases.Windows(), processing_class=tokenizer,
    )  # fmt: skip
    trainer.save_model(str(tmp_path / "saved"))
    trainer.pipe.close()
    reloaded = AutoTokenizer.from_pretrained(tmp_path / "saved")
    assert reloaded.get_vocab() == tokenizer.get_vocab() and reloaded.pad_token == "w0"
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    assert all(torch.equal(v, loaded.state_dict()[k]) for k, v in trainer.pipe.state_dict().items())


def test_a_lora_adapter_trains_saves_and_resumes(tmp_path: Path) -> None:
    peft = pytest.importorskip("peft")

    from gpipe_fast.integrations.transformers import PipelineTrainer

    def lora() -> Any:
        config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
        return peft.get_peft_model(cases.model("llama"), config)

    def run(folder: Path, **kwargs: Any) -> Any:
        trainer = PipelineTrainer(model=lora(), args=cases.arguments(str(folder), **kwargs),
                                  train_dataset=cases.Windows(32))  # fmt: skip
        return trainer

    whole = run(tmp_path / "whole", save_strategy="steps", save_steps=2)
    assert whole.pipe.split_points == ["base_model.model.model.layers.2"]
    whole.train()
    trained = {k: v.clone() for k, v in whole.pipe.state_dict().items() if "lora_" in k}
    whole.pipe.close()
    checkpoint = tmp_path / "whole" / "checkpoint-4"
    assert {"adapter_model.safetensors", "adapter_config.json"} <= set(os.listdir(checkpoint))
    reloaded = peft.PeftModel.from_pretrained(cases.model("llama"), checkpoint)
    for key, tensor in trained.items():
        assert torch.equal(reloaded.state_dict()[key], tensor), key

    resumed = run(tmp_path / "resumed")
    resumed.train(resume_from_checkpoint=str(tmp_path / "whole" / "checkpoint-2"))
    resumed.pipe.close()
    losses = {h["step"]: h["loss"] for h in resumed.state.log_history if "loss" in h}
    assert losses == {h["step"]: h["loss"] for h in whole.state.log_history if "loss" in h}
