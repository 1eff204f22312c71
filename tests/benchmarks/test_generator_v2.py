"""Generator v2, research code: it still writes what it wrote before v3 existed, through the library's writer."""

import hashlib
from pathlib import Path

import numpy as np

from benchmarks import generator_v2
from slipcache.data.dataset import CriteoDataset
from slipcache.data.synthetic.ceiling import no_ceiling_reason


def test_v2_reproduces_earlier_output(tmp_path: Path) -> None:
    """The bytes of every split equal those of the generator before v3 existed (commit 8872c6f)."""
    out = tmp_path / "v2"
    generator_v2.main(["--out", str(out), "--samples", "5000", "--scale", "0.001", "--seed", "7"])
    ds = CriteoDataset(out)
    digest = hashlib.sha256()
    for name in ("train", "val", "test"):
        split = ds.split(name)
        for array in (split.labels, split.dense, split.sparse):
            digest.update(np.ascontiguousarray(array).tobytes())
    assert digest.hexdigest()[:16] == "357ab3b19f55b59d"
    assert ds.meta["generator"]["version"] == 2 and not ds.meta["time_ordered"]
    assert "no latent sources" in (no_ceiling_reason(ds.meta) or "")
