"""The knobs a DLRM user looks for: MLP sizes, the interaction, the MLPerf learning-rate schedule, the MLP
optimizer, bf16 autocast; each a flag, a config-file key, recorded in config.json and kept on resume."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from slipcache.model import DLRM, ModelConfig, build_embeddings
from slipcache.training import trainer
from slipcache.training.cli import add_train_arguments
from slipcache.training.config import CONFIG_FIELDS, load_config_file, make_config
from slipcache.training.schedule import lr_factor
from slipcache.training.stopping import CheckpointTimer
from tests.helpers import make_dataset
from tests.helpers import tiny_config as tiny


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_dataset(tmp_path_factory.mktemp("data"))


def _model(**options: object) -> DLRM:
    config = ModelConfig(table_sizes=[10, 20, 30], embedding_dim=4, bottom_mlp=[8, 4], top_mlp=[8, 1], **options)
    return DLRM(config, build_embeddings(config.table_sizes, 4, embeddings="torch"))


def test_the_cat_interaction_puts_the_vectors_side_by_side() -> None:
    model = _model(interaction="cat")
    assert model.config.interaction_dim == 4 * 4 and model.top[0].in_features == 16
    dense, sparse = torch.randn(5, 13), torch.randint(0, 10, (5, 3))
    x, emb = model.bottom(dense), model.embeddings(sparse)
    torch.testing.assert_close(model.interact(x, emb), torch.cat([x, emb.flatten(1)], dim=1))
    assert model(dense, sparse).shape == (5,)
    assert _model().config.interaction_dim == 4 + 4 * 3 // 2  # dot: D + (T+1)T/2


def test_bf16_autocast_runs_the_mlps_in_bf16_and_returns_fp32_logits() -> None:
    torch.manual_seed(0)
    fp32 = _model()
    bf16 = _model(autocast="bf16")
    bf16.load_state_dict(fp32.state_dict())
    seen: list[torch.dtype] = []
    bf16.top[0].register_forward_hook(lambda module, args, out: seen.append(out.dtype))
    dense, sparse = torch.randn(64, 13), torch.randint(0, 10, (64, 3))
    logits = bf16(dense, sparse)
    assert seen == [torch.bfloat16] and logits.dtype == torch.float32
    torch.testing.assert_close(logits, fp32(dense, sparse), atol=0.05, rtol=0.05)  # bf16: 3 significant digits
    logits.sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in bf16.dense_parameters())


def test_mlperf_schedule_warms_up_holds_and_decays_quadratically() -> None:
    warmup, start, steps = 4, 10, 5
    factors = [lr_factor(step, warmup, start, steps) for step in range(18)]
    assert factors[:4] == [0.25, 0.5, 0.75, 1.0] and factors[4:10] == [1.0] * 6
    assert factors[10:15] == pytest.approx([1.0, 0.64, 0.36, 0.16, 0.04])
    assert factors[15:] == pytest.approx([0.04] * 3)  # the last decayed rate, as the reference freezes it: no floor
    assert [lr_factor(s, 0, 100, 0) for s in (0, 200)] == [1.0, 1.0]  # no warm-up, no decay: constant


KNOBS = ["--dim", "8", "--bottom-mlp", "32,8", "--top-mlp", "16,1", "--interaction", "cat", "--dense-optimizer",
         "adam", "--autocast", "bf16", "--lr-schedule", "mlperf", "--lr-warmup-steps", "3", "--lr-decay-start", "20",
         "--lr-decay-steps", "6", "--checkpoint-minutes", "5", "--no-checkpoint-on-interrupt"]  # fmt: skip
SET = {"bottom_mlp": [32, 8], "top_mlp": [16, 1], "interaction": "cat", "dense_optimizer": "adam", "autocast": "bf16",
       "lr_schedule": "mlperf", "lr_warmup_steps": 3, "lr_decay_start": 20, "lr_decay_steps": 6,
       "checkpoint_minutes": 5.0, "checkpoint_on_interrupt": False}  # fmt: skip


def test_the_knobs_are_flags_and_config_file_keys(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_train_arguments(parser)
    flags = {k: v for k, v in vars(parser.parse_args(KNOBS)).items() if k in CONFIG_FIELDS}
    from_flags = make_config({}, flags)
    toml = tmp_path / "knobs.toml"
    toml.write_text("".join(f"{k} = {json.dumps(v) if not isinstance(v, bool) else str(v).lower()}\n"
                            for k, v in {**SET, "embedding_dim": 8}.items()))
    from_file = make_config(load_config_file(toml), {})
    for name, value in SET.items():
        assert from_flags.get(name) == from_file.get(name) == value, name


def test_a_run_trains_with_the_knobs_records_them_and_a_resume_keeps_them(data_dir: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    seen: list[tuple[float, float]] = []
    real_step = trainer.train_step

    def step(loop: Any, batch: Any, batches: Any = None) -> Any:
        # torch tables: their optimizer
        seen.append((loop.run.dense_opt.param_groups[0]["lr"], loop.run.emb_opt.param_groups[0]["lr"]))
        return real_step(loop, batch, batches)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(trainer, "train_step", step)
        patch.setattr(trainer, "finish_run", lambda r: (_ for _ in ()).throw(KeyboardInterrupt))
        with pytest.raises(KeyboardInterrupt):  # trained, final checkpoint written, then stopped
            trainer.train(tiny(data_dir, run, epochs=1, embedding_dim=8, lr=0.2, dense_lr=0.1, **SET))
    recorded = json.loads((run / "config.json").read_text())
    assert {name: recorded[name] for name in SET} == SET
    steps = len(seen)  # 1984 samples of batch 64
    assert steps == 31
    factors = [lr_factor(s, 3, 20, 6) for s in range(steps)]
    assert seen == [pytest.approx((0.1 * f, 0.2 * f)) for f in factors]
    resumed = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(trainer, "finish_run", lambda loop: resumed.setdefault("loop", loop) and {})
        trainer.train(make_config({}, {"resume": str(run), "progress": False}))
    loop = resumed["loop"]
    r = loop.run
    assert isinstance(r.dense_opt, torch.optim.Adam) and r.dense_opt.state  # its moments came back
    assert r.model.config.interaction == "cat" and r.model.top[0].in_features == 27 * 8
    assert r.model.config.autocast == "bf16" and r.config.schedule.checkpoint_minutes == 5.0
    timers = [c for c in loop.callbacks if isinstance(c, CheckpointTimer)]
    assert [(t.seconds, t.on_signal) for t in timers] == [(300.0, False)]  # every 5 minutes, no signal handler
