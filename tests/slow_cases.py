"""Which tests run in the full suite only (pytest --full, or GPIPE_FAST_FULL_TESTS=1, as CI
runs it): the long sweeps, soaks and builds, listed here in one place, each with why.

The fast suite (plain `pytest`) keeps at least one case of every feature and every schedule,
in one process and across processes: a sweep keeps its first or plainest case, and its other
cases (more checkpoint modes, cell counts, chunk counts, transports, fault points) run in
the full suite. A key is a test module ("test_soak.py") or a test ("test_x.py::test_name");
its rule is True (every case) or a function of the case's parameters (its callspec, by
argument name) that says which cases are slow. Tests may also carry @pytest.mark.slow
themselves; tests/conftest.py applies both.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

Case = dict[str, Any]
Rule = bool | Callable[[Case], bool]


def _not(**kept: object) -> Callable[[Case], bool]:
    """Slow unless every named parameter has the value given (a tuple: one of its values)."""

    def slow(case: Case) -> bool:
        return not all(
            case.get(name) in (value if isinstance(value, tuple) else (value,))
            for name, value in kept.items()
        )

    return slow


# A sweep's fast case is its default checkpoint mode ("except_last"), so that every
# schedule keeps its case; the other modes re-run the same schedule with more or less
# recomputation.
DEFAULT_MODE = _not(checkpoint="except_last")

SLOW: dict[str, Rule] = {
    # Thousands of steps each, watching threads, memory and objects stay flat.
    "test_soak.py": True,
    # The C++ unit tests are built and run in the fast suite; under the sanitizers they
    # build everything a second time.
    "test_cpp.py::test_cpp_unit_tests_pass_under_asan_and_ubsan": True,
    # Real transformers models: one model per kind of test in the fast suite.
    "test_any_model.py::test_one_process_every_schedule_is_exact": _not(
        name="llama", schedule="1f1b"
    ),
    "test_any_model.py::test_more_models_in_one_process_are_exact": _not(name="bert"),
    "test_any_model.py::test_two_processes_are_exact": _not(name="llama", schedule="1f1b"),
    "test_any_model.py::test_pipeline_and_data_parallel_with_the_head_tied_across_ranks": True,
    # Checkpoints of any model: GPT-2 (its head tied across the ranks) in the fast suite.
    "test_any_model_checkpoints.py::test_state_dicts_use_the_models_own_keys": _not(model="gpt2"),
    "test_any_model_checkpoints.py::test_a_pp2_checkpoint_resumes_in_the_plain_model": _not(
        model="gpt2"
    ),
    "test_any_model_checkpoints.py::test_a_pp2_checkpoint_resumes_at_another_split": _not(
        model="gpt2"
    ),
    "test_any_model_checkpoints.py::test_the_whole_models_state_dict_loads_on_each_rank": _not(
        model="gpt2"
    ),
    "test_any_model_checkpoints.py::test_a_pp2_checkpoint_resumes_at_pp2_by_dp2": True,
    # bench/any_model.py at toy size: both libraries across two processes.
    "test_bench_any_model.py": True,
    # bench/compiled.py at toy size: compiles, in one process and two.
    "test_bench_compiled.py": True,
    # Splits anywhere: the head and inside a layer in the fast suite.
    "test_any_model.py::test_any_module_the_forward_calls_is_a_split_point": lambda case: (
        case["points"] not in (["lm_head"], ["model.layers.2.mlp"])
    ),
    "test_any_model.py::test_a_split_at_the_first_decoder_layer_is_exact": _not(model_name="bart"),
    "test_any_model.py::test_every_rank_names_a_tied_parameter_as_the_plain_model": _not(
        model="gpt2"
    ),
    "test_any_model_modes.py::test_an_encoders_dropout_follows_the_pipes_mode": lambda case: (
        len(case["points"]) > 1
    ),
    "test_any_model_modes.py::test_transformer_encoder_in_evaluation_with_a_padding_mask": (
        lambda case: case["point"] != "encoder.layers.1" or case["grad_off"].__name__ != "no_grad"
    ),
    "test_any_model_moe.py::test_the_auxiliary_router_loss_is_exact": lambda case: (
        case["points"] != ["model.layers.2"]
    ),
    # bench/hf_sweep.py: one architecture in the fast suite (LLaMA; 19 s a case: an
    # encoder-decoder split anywhere keeps its fast case in test_any_model.py's BART), a wider
    # sample in the full one; the whole sweep (hundreds of models, an hour) is the bench's
    # --check.
    "test_hf_sweep.py::test_a_few_architectures_are_exact_at_every_split": _not(model_type="llama"),
    "test_hf_sweep.py::test_more_architectures_meet_the_sweep_targets": True,
    "test_any_model.py::test_batch_norm_trains_exactly_and_shape_runs_leave_modules_untouched": (
        _not(schedule="1f1b")
    ),
    # The float64 harness: every schedule on GPT-2 in one process, every model on 1f1b in
    # one process and on two.
    "test_exact_models.py::test_one_process": lambda case: (
        not (case["name"] == "gpt2" or case["schedule"] == "1f1b")
    ),
    "test_exact_models.py::test_two_processes": _not(schedule="1f1b"),
    # pp x dp on four processes keeps its case in test_multiprocess.py.
    "test_exact_models.py::test_pipeline_and_data_parallel_with_a_weight_tied_across_ranks": True,
    # One process: every schedule in the default mode; uneven micro-batches for every
    # schedule, the even batch and N < M on 1f1b.
    "test_train_step.py::test_loss_and_gradients_equal_the_whole_batch": lambda case: (
        not (
            case["checkpoint"] == "except_last"
            and (case["batch"] == 11 or case["schedule"] == "1f1b")
        )
    ),
    "test_evaluate.py::test_loss_equals_the_whole_batch_and_nothing_learns": lambda case: (
        not (
            case["checkpoint"] == "except_last"
            and (case["batch"] == 11 or case["schedule"] == "1f1b")
        )
    ),
    # Losses over counted items: every schedule keeps its default mode; the first model of
    # each kind of run across processes stays (GPT-2, given num_items_in_batch).
    "test_items.py::test_cross_entropy_with_ignore_index_equals_the_whole_batch": DEFAULT_MODE,
    "test_items.py::test_two_processes": _not(schedule="1f1b"),
    "test_model_items.py::test_every_schedule": _not(schedule=("1f1b", "zbv")),
    # Items counted per window: a decoder (GPT-2) and an encoder-decoder (T5) in the fast
    # suite, each model at one window length (2 and 3 steps), the other two in the full one;
    # padded labels of GPT-2, T5 and BERT (masked, its own mean), LLaMA's (shifted and
    # counted as GPT-2's) in the full suite.
    "test_model_items.py::test_accumulated_steps_each_average_their_own_items_and_clip_after": (
        lambda case: (case["name"], case["accumulate"]) not in (("gpt2", 2), ("t5", 3))
    ),
    "test_model_items.py::test_padded_labels_equal_the_whole_batch": _not(
        name=("gpt2", "t5", "bert")
    ),
    "test_model_items.py::test_two_processes": _not(name="gpt2", transport=""),
    "test_model_items.py::test_pipeline_and_data_parallel_with_lopsided_replicas": _not(
        name="gpt2", dp_shard=False
    ),
    "test_gpipe.py::test_matches_unpartitioned_module": DEFAULT_MODE,
    "test_pytree.py::test_train_step_equals_the_plain_model": DEFAULT_MODE,
    "test_pytree.py::test_pipe_call_and_backward_equal_the_plain_model": DEFAULT_MODE,
    "test_skip_pipe.py::test_skips_equal_the_plain_sequential": _not(
        checkpoint="except_last", cells=4
    ),
    "test_skip_pipe.py::test_no_skip_tensor_is_held_after_a_step": DEFAULT_MODE,
    "test_skip_pipe.py::test_unet_in_a_pipe": DEFAULT_MODE,
    # Faults: every place a fault can strike, at the first micro-batch (a cell's: in the
    # middle cell, with recomputation on, so that it can strike there too; a train_step
    # action's: in the last cell, which runs every kind of action).
    "test_faults.py::test_fault_in_a_cell_reaches_caller_and_pipe_recovers": _not(
        cell=1, m=0, checkpoint="always"
    ),
    "test_faults.py::test_fault_in_a_train_step_action_reaches_caller_and_pipe_recovers": _not(
        cell=2, m=0
    ),
    "test_faults.py::test_fault_in_a_boundary_copy_is_named_as_such": _not(m=0),
    # Across processes: every schedule on two processes (test_multiprocess.py), one case
    # of each other feature.
    "test_multiprocess.py::test_pipeline_and_data_parallel_on_four_processes": _not(
        schedule="1f1b"
    ),
    "test_multiprocess.py::test_evaluation_on_two_processes_every_schedule": _not(
        schedule=("1f1b", "zbv")
    ),
    "test_multiprocess.py::test_a_tied_weight_is_reduced_once_per_group": _not(
        layout=("dp alone, tie within the process", "pp x dp, tie across ranks")
    ),
    "test_multiprocess.py::test_clip_grad_norm_is_the_whole_models": _not(
        layout="pp x dp, tie across ranks"
    ),
    "test_accumulate.py::test_steps_accumulate_across_processes": _not(schedule="1f1b"),
    "test_skip_processes.py::test_skips_between_two_processes_equal_the_plain_sequential": (
        lambda case: (
            not (
                case["schedule"] == "1f1b"
                or (case["schedule"] == "zbv" and case["scenario"] == "across")
            )
        )
    ),
    "test_skip_processes.py::test_skips_over_processes_in_between": _not(schedule="1f1b"),
    "test_skip_processes.py::test_every_checkpoint_mode_across_processes": _not(
        schedule="zbv", checkpoint="always"
    ),
    "test_dcp_resume.py::test_resumes_at_pp2_or_dp2": _not(flat=False),
    "test_dcp_resume.py::test_resumes_in_one_process": _not(flat=False),
    "test_dcp_resume.py::test_a_checkpoint_of_the_plain_model_resumes_at_pp2": _not(flat=False),
    # A killed rank named by the survivor; the store's host killed, a rank of another
    # pipeline, a death mid-save (test_checkpoint.py keeps one) in the full suite.
    "test_killed_rank.py::test_a_killed_rank_of_two_is_named_and_the_survivor_exits": _not(
        killed=1
    ),
    "test_killed_rank.py::test_a_killed_rank_of_another_pipeline_is_not_blamed_on_a_live_rank": (
        True
    ),
    "test_killed_rank.py::test_a_rank_killed_during_a_dcp_save_is_named": True,
    # Resharding a checkpoint keeps its fast cases in test_dcp_resume.py.
    "test_checkpoint.py::test_resumes_at_pp2_by_dp2": True,
    # The demo: every schedule in one process; across processes the two-cells-per-worker
    # schedules (refused there once) and the example's default.
    "test_demo.py::test_demo_takes_every_schedule_across_processes": _not(schedule=("1f1b", "zbv")),
    "test_demo_processes.py::test_every_schedule_trains_across_processes_as_the_plain_model": (
        _not(schedule="1f1b")
    ),
    # The U-Net's skips across cells and processes keep their cases in test_unet_example.py
    # and test_skip_processes.py.
    "test_demo.py::test_demo_trains_the_unet_whose_skips_cross_cells": True,
    "test_demo_processes.py::test_the_unet_across_two_processes_sends_its_skips_between_them": True,
    # examples/train_lm.py: it learns; a bitwise resume (test_dcp_resume.py keeps it), by
    # hand or by torchrun's restart in place, the other layouts and schedules in the full
    # suite.
    "test_train_lm.py::test_a_job_killed_mid_save_relaunched_by_hand_ends_bitwise_equal": True,
    # examples/train_hf.py written at pp2 under torchrun and resumed in one process (38 s on 2
    # cores); checkpoints of pipes of any model keep their fast cases in
    # test_any_model_checkpoints.py. Its run against the plain model (in process) stays.
    "test_train_hf.py::test_a_pp2_checkpoint_resumes_in_one_process": True,
    "test_train_lm.py::test_a_killed_rank_restarted_in_place_ends_bitwise_equal": True,
    "test_train_lm.py::test_a_pp2_checkpoint_resumes_at_another_layout": True,
    "test_train_lm.py::test_other_schedules_bf16_and_clipping_run": True,
    # Sharded stages (dp_shard): the fast suite keeps one case per feature; the sweeps of
    # schedules x policies, checkpoint modes, collective counts and models run in full.
    "test_sharded.py::test_pp_by_sharded_dp_every_schedule": _not(
        schedule=("1f1b", "zbv"), sync="per_microbatch"
    ),
    "test_sharded.py::test_sharded_dp_alone_every_checkpoint_mode": _not(
        schedule="gpipe", checkpoint="always"
    ),
    "test_sharded.py::test_collectives_per_step_follow_the_formula": _not(
        schedule=("1f1b", "zero_bubble")
    ),
    "test_sharded.py::test_clip_scaler_optimizer_and_eval_on_shards": _not(schedule="zbv"),
    "test_sharded.py::test_gradients_accumulate_across_steps": _not(schedule="zbv"),
    "test_sharded.py::test_any_model_sharded_over_dp": _not(model="gpt2"),
    "test_sharded.py::test_a_weight_tied_across_ranks_is_sharded": _not(schedule="1f1b"),
    # "auto" across processes keeps its two-rank cases in the fast suite; the 2 x 2 mesh
    # starts four workers for one more agreement.
    "test_tune_processes.py::test_a_pp_by_dp_mesh_tunes_as_one": True,
    # Failures under dp_shard: a rank that raises, every victim of pp 2 x dp 2 under both
    # policies, runs in the pool (under a second each); one that dies takes a job of four
    # fresh processes (20 s), so its sweep runs in full, one victim in the fast suite.
    "test_sharded_comms.py::test_a_rank_that_dies_is_named_by_every_other": _not(
        victim=1, sync="per_step"
    ),
    "test_sharded_comms.py::test_a_slow_rank_is_named_as_slow_by_every_rank_itself_included": (
        _not(shard=True)
    ),
    # Ranks that build differently: two ranks name every argument in the fast suite; pp 2 x
    # dp 2 (dp_shard and its policy, four more processes to start) in full.
    "test_agreement.py::test_every_rank_of_pp2_by_dp2_names_the_argument_that_differs": True,
    # Ctrl-C across processes: the interrupted rank waiting for its peer or in a collective;
    # Ctrl-C inside a long forward, its peer told, in full.
    "test_ctrl_c_processes.py::test_a_peer_learns_of_ctrl_c_inside_a_long_forward_at_once": True,
    # Compiled blocks: every schedule in the default mode; the other modes in full.
    "test_compiled.py::test_compiled_blocks_run_compiled_and_exact": DEFAULT_MODE,
    # A model's own checkpoint with dropout: every schedule in the default mode.
    "test_randomness.py::test_a_models_own_checkpoint_replays_its_dropout": DEFAULT_MODE,
    "test_randomness.py::test_gpt2_with_dropout_and_gradient_checkpointing": DEFAULT_MODE,
    # PipelineTrainer (each case a Trainer run against a plain Trainer's): GPT-2, whose head
    # is tied across the stages, keeps every kind of run in the fast suite (one process,
    # pp=2, pp2 x dp2, resumes, save_model); LLaMA's twins, the stages sharded over the
    # replicas, a resume at pp2 x dp2 and compute_loss_func on padded batches run in full.
    "test_pipeline_trainer.py::test_one_process_equals_the_plain_trainer": _not(name="gpt2"),
    "test_pipeline_trainer.py::test_two_processes_equal_the_plain_trainer": _not(name="gpt2"),
    "test_pipeline_trainer.py::test_save_model_then_from_pretrained_gives_the_trained_weights": (
        _not(name="gpt2")
    ),
    "test_pipeline_trainer.py::test_stages_sharded_over_the_replicas_equal_the_plain_trainer": True,
    "test_pipeline_trainer.py::test_resuming_at_pp2_by_dp2_gives_the_same_losses": True,
    "test_pipeline_trainer.py::test_bf16_autocast_reaches_the_stages": True,
    "test_pipeline_trainer.py::test_padded_batches_count_tokens_as_the_plain_trainer": _not(
        loss="the model's own"
    ),
    "test_pretrained.py::test_pretrained_weights_load_into_a_model_built_on_meta": _not(
        family="gpt2"
    ),
    # examples/trainer_hf.py under torchrun at pp=2, resumed (31 s on 2 cores); the
    # one-process run stays, and test_pipeline_trainer.py's ranks run every layout.
    "test_trainer_hf.py::test_pp2_saves_shards_and_a_checkpoint_resumes_with_the_same_losses": True,
    # The two benchmarks at toy size: several torchrun jobs each.
    "test_bench_trainer.py": True,
}


def is_slow(item: pytest.Item) -> bool:
    """Whether `item` is in the full suite only, by SLOW."""
    rule = SLOW.get(item.path.name)
    if rule is None:
        name = getattr(item, "originalname", item.name)
        rule = SLOW.get(f"{item.path.name}::{name}", False)
    if isinstance(rule, bool):
        return rule
    callspec = getattr(item, "callspec", None)
    return bool(rule(dict(callspec.params) if callspec is not None else {}))
