"""Losses that average over counted items, for test_items.py and test_model_items.py: padded,
unevenly counted batches, the plain model's reference run (on the whole global batch, the
accumulated steps, clipping), and the cases the Cluster workers run."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import any_model_cases as models
import torch
from torch import Tensor, nn

import gpipe_fast as gf

from helpers import whole

VOCAB = models.VOCAB
IGNORE = -100
# The loss of a transformers model through `labels` is computed in float32 whatever the
# model's dtype (ForCausalLMLoss upcasts the logits); its gradients, float64 elsewhere, stay
# exact (the float32 part computes each element as the plain model does).
LOSS_TOLERANCE = 2e-6
EXACT = 1e-12


def counted_labels(
    labels: Tensor, step: int, *, empty_rows: tuple[int, ...] = (), masked: bool = False
) -> Tensor:
    """`labels` with -100 from a random point of each row on (padding: 0 to all of it), on
    `empty_rows` entirely, and on about half the rest too with `masked` (a masked LM's)."""
    generator = torch.Generator().manual_seed(1000 + step)
    labels = labels.clone()
    size, length = labels.shape
    ends = torch.randint(0, length + 1, (size,), generator=generator)
    for row in range(size):
        labels[row, ends[row] :] = IGNORE
    for row in empty_rows:
        labels[row] = IGNORE
    if masked:
        labels[torch.rand(labels.shape, generator=generator) < 0.5] = IGNORE
    return labels


def padded_inputs(
    name: str, size: int, length: int, step: int, empty_rows: tuple[int, ...] = ()
) -> dict[str, Tensor]:
    """Model `name`'s inputs with `labels` padded and masked with -100 (see counted_labels)."""
    batch = models.inputs(name, size, length, step)
    labels = batch.get("labels", batch["input_ids"])
    batch["labels"] = counted_labels(labels, step, empty_rows=empty_rows, masked=name == "bert")
    return batch


def shifts(name: str) -> bool:
    """Whether the model's loss shifts its labels (a causal LM's)."""
    return name in ("gpt2", "llama", "qwen2", "gemma2")


def items_of(name: str, labels: Tensor) -> int:
    """The labels model `name` averages over, counted by the test itself."""
    return int(((labels[..., 1:] if shifts(name) else labels) != IGNORE).sum())


def own_loss(output: Any, _target: None) -> Tensor:
    return output.loss  # type: ignore[no-any-return]


def own_loss_against_plain(
    name: str,
    make_pipe: Callable[[nn.Module, dict[str, Tensor]], Any],
    batches: list[dict[str, Tensor]],
    *,
    replica: int = 0,
    replicas: int = 1,
    accumulate: int = 1,
    clip: float | None = None,
    given: bool = False,
    evaluate: bool = False,
    device: str = "cpu",
) -> dict[str, Any]:
    """The model's own loss (target None) through the pipe and the plain model on the whole
    global batches side by side, with SGD. Gradients accumulate over `accumulate` steps
    before each optimizer step (clipped to `clip` then); with `given`, every step of a window
    divides by the items of the whole window (num_items_in_batch, as the Trainer counts),
    else by its own. Per step: both losses and dtypes, and this process's worst relative
    gradient error (after a window's last step, and after its clipping); then the worst
    parameter error; with `evaluate`, eval_step's loss on the last batch and the plain one.
    The models start on `device`, where the batches must be."""
    model = models.make_model(name).to(device)
    plain = copy.deepcopy(model)
    example = {key: value[:2] for key, value in batches[0].items()}
    pipe = make_pipe(model, example)
    takes_count = name in ("gpt2", "llama")  # forwards that divide by num_items_in_batch
    try:
        optimizer = torch.optim.SGD(pipe.parameters(), lr=0.5)
        plain_optimizer = torch.optim.SGD(plain.parameters(), lr=0.5)
        reference = dict(plain.named_parameters(remove_duplicate=False))
        steps: list[dict[str, Any]] = []
        for start in range(0, len(batches), accumulate):
            window = batches[start : start + accumulate]
            total = sum(items_of(name, batch["labels"]) for batch in window)
            optimizer.zero_grad(set_to_none=True)
            plain_optimizer.zero_grad(set_to_none=True)
            for index, batch in enumerate(window):
                share = {k: v.tensor_split(replicas)[replica] for k, v in batch.items()}
                extra = {"num_items_in_batch": total} if given else {}
                loss = pipe.train_step(share, None, own_loss, **extra)
                if given and takes_count:
                    want = plain(**batch, num_items_in_batch=torch.tensor(total)).loss
                else:
                    want = plain(**batch).loss
                    if given:  # the model's mean over its items, as their share of the total
                        want = want * (items_of(name, batch["labels"]) / total)
                want.backward()
                last = index == len(window) - 1
                norms = None
                if last and clip is not None:
                    norms = (
                        pipe.clip_grad_norm_(clip).item(),
                        torch.nn.utils.clip_grad_norm_(plain.parameters(), clip).item(),
                    )
                steps.append({
                    "loss": loss.item(), "plain": want.item(), "dtype": str(loss.dtype),
                    "plain_dtype": str(want.dtype), "grad_error": _worst(pipe, reference),
                    "norms": norms,
                })  # fmt: skip
            optimizer.step()
            plain_optimizer.step()
        result: dict[str, Any] = {"steps": steps, "param_error": _param_error(pipe, reference)}
        if evaluate:
            batch = batches[-1]
            share = {k: v.tensor_split(replicas)[replica] for k, v in batch.items()}
            got = pipe.eval_step(share, None, own_loss)
            with torch.no_grad():
                want = plain(**batch).loss
            result["eval"] = (got.item(), want.item(), str(got.dtype), str(want.dtype))
    finally:
        pipe.close()
    return result


def _worst(pipe: Any, reference: dict[str, nn.Parameter]) -> float:
    """The worst relative gradient error of this process's parameters (a gradient that is
    zero in exact arithmetic, an attention key's bias, measured against a floor)."""
    norms = [p.grad.norm() for p in reference.values() if p.grad is not None]
    floor = 1e-6 * torch.stack(norms).norm().item()
    worst = 0.0
    for key, param in pipe.named_parameters(remove_duplicate=False):
        want = reference[key].grad
        assert (param.grad is None) == (want is None), key
        if want is not None:
            worst = max(worst, models.relative(whole(param.grad), want, floor))
    return worst


def _param_error(pipe: Any, reference: dict[str, nn.Parameter]) -> float:
    floor = 1e-6 * torch.stack([p.norm() for p in reference.values()]).norm().item()
    return max(models.relative(whole(p), reference[k], floor) for k, p in pipe.named_parameters())


def check_own_loss(result: dict[str, Any], exact: float = EXACT) -> None:
    """The pipe's losses (in the plain model's dtype), gradients, clipping norms and
    parameters equal the plain model's."""
    for step, got in enumerate(result["steps"]):
        assert abs(got["loss"] - got["plain"]) <= LOSS_TOLERANCE * abs(got["plain"]), (step, got)
        assert got["dtype"] == got["plain_dtype"], (step, got)
        assert got["grad_error"] < exact, (step, got)
        if got["norms"] is not None:
            pipe_norm, plain_norm = got["norms"]
            assert abs(pipe_norm - plain_norm) <= exact * plain_norm, (step, got)
    assert result["param_error"] < exact
    if "eval" in result:
        loss, want, dtype, want_dtype = result["eval"]
        assert abs(loss - want) <= LOSS_TOLERANCE * abs(want) and dtype == want_dtype


def uneven_batches(
    name: str, shapes: list[tuple[int, int]], empty_rows: tuple[int, ...] = ()
) -> list[dict[str, Tensor]]:
    return [padded_inputs(name, size, length, 10 + step, empty_rows)
            for step, (size, length) in enumerate(shapes)]  # fmt: skip


def lopsided_batch(name: str, size: int, length: int, step: int) -> dict[str, Tensor]:
    """A batch whose first half (replica 0's) counts a label or two per row and whose second
    half (replica 1's) counts nearly all: replicas holding very different numbers of items."""
    batch = models.inputs(name, size, length, step)
    labels = batch.get("labels", batch["input_ids"]).clone()
    labels[: size // 2, 3:] = IGNORE
    labels[size // 2 :, length - 1 :] = IGNORE
    batch["labels"] = labels
    return batch


def across(
    rank: int, world: int, *, model: str, schedule: str, stages: int, pp: int,
    batches: list[dict[str, Tensor]], dp_shard: bool = False, **options: Any,
) -> dict[str, Any]:  # fmt: skip
    """A Cluster case: own_loss_against_plain on `world` processes, `pp` per pipeline and the
    rest data-parallel replicas (T5 in two stages: its encoder, its decoder)."""
    from dist_cases import groups

    dp = world // pp
    pp_group, dp_group, replica = groups(pp, dp)
    points = ["decoder.block.0"] if model == "t5" else models.split_points(model, stages)

    def make(net: nn.Module, example: dict[str, Tensor]) -> Any:
        return gf.pipeline(net, example, points, chunks=3,
                           schedule=schedule, pp_group=pp_group, dp_group=dp_group,
                           timeout=60, dp_shard=dp_shard)  # fmt: skip

    return own_loss_against_plain(model, make, batches, replica=replica, replicas=dp, **options)


# --- an nn.Sequential with CrossEntropyLoss(ignore_index=-100) ------------------------------


def token_model(width: int = 8) -> nn.Sequential:
    """Tokens -> logits (batch, length, vocabulary), float64, in four layers."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Embedding(VOCAB, width), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, VOCAB)
    ).double()


CRITERION = nn.CrossEntropyLoss(ignore_index=IGNORE)


def token_loss(logits: Tensor, target: Tensor) -> Tensor:
    """The plain mean over the target's tokens that are not -100."""
    return CRITERION(logits.flatten(0, 1), target.flatten())


def token_batch(
    size: int, length: int, step: int, empty_rows: tuple[int, ...] = ()
) -> tuple[Tensor, Tensor]:
    ids = models.tokens(size, length, step)
    return ids, counted_labels(ids.roll(-1, 1), step, empty_rows=empty_rows)


def sequential_across(
    rank: int, world: int, *, pp: int, schedule: str, batches: list[tuple[Tensor, Tensor]],
    accumulate: int = 1,
) -> dict[str, Any]:  # fmt: skip
    """A Cluster case: the token model cut in `pp` processes (the rest replicas), trained
    with reduction=gf.ItemMean() against the plain model on the whole global batches."""
    from dist_cases import groups

    dp = world // pp
    pp_group, dp_group, replica = groups(pp, dp)
    model = token_model()
    plain = copy.deepcopy(model)
    per = 2 if schedule in ("interleaved", "zbv") else 1
    balance = [4 // (pp * per)] * (pp * per)
    pipe = gf.GPipe(model, balance, chunks=3, schedule=schedule, pp_group=pp_group,
                    dp_group=dp_group, timeout=60)  # fmt: skip
    losses, errors = [], []
    try:
        for start in range(0, len(batches), accumulate):
            pipe.zero_grad(set_to_none=True)
            plain.zero_grad(set_to_none=True)
            for x, y in batches[start : start + accumulate]:
                mine = (x.tensor_split(dp)[replica], y.tensor_split(dp)[replica])
                loss = pipe.train_step(*mine, token_loss, reduction=gf.ItemMean())
                want = token_loss(plain(x), y)
                want.backward()
                losses.append((loss.item(), want.item()))
                reference = dict(plain.named_parameters())
                errors.append(max(
                    models.relative(whole(p.grad), reference[k].grad)
                    for k, p in pipe.named_parameters()
                ))  # fmt: skip
    finally:
        pipe.close()
    return {"losses": losses, "errors": errors}
