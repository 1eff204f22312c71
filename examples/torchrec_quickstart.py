"""The README's TorchRec snippet, whole: TorchRec's DLRM with slipcache's INT8 tables behind a 5 % fp32 cache.

    python examples/torchrec_quickstart.py

Needs the torchrec extra (README, "Using slipcache with TorchRec"). A test runs this file, so the README's
snippet cannot drift from code that works. `examples/torchrec_dlrm.py` is the full training script.
"""

import torch
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.models.dlrm import DLRM

from slipcache.interop.torchrec import KeyedCachedEmbeddingBagCollection

table_sizes = [1460, 583, 10_000] + [100] * 23  # rows per table (Criteo has 26 categorical features)
batch = 256

tables = [EmbeddingBagConfig(name=f"t_cat_{t}", embedding_dim=16, num_embeddings=n, feature_names=[f"cat_{t}"])
          for t, n in enumerate(table_sizes)]
ebc = KeyedCachedEmbeddingBagCollection(tables, precision="int8", cache_size=0.05, lr=0.1)
model = DLRM(embedding_bag_collection=ebc, dense_in_features=13,
             dense_arch_layer_sizes=[512, 256, 16], over_arch_layer_sizes=[512, 256, 1])
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # the dense parameters: the tables update in backward

dense = torch.rand(batch, 13)                                        # 13 dense features per sample
ids = torch.stack([torch.randint(0, n, (batch,)) for n in table_sizes])  # one id per feature and sample
kjt = KeyedJaggedTensor.from_lengths_sync(                           # features, then samples: [F * B]
    keys=[f"cat_{t}" for t in range(len(table_sizes))], values=ids.reshape(-1),
    lengths=torch.ones(ids.numel(), dtype=torch.int64),
)
labels = (torch.rand(batch) < 0.25).float()

logits = model(dense, kjt).squeeze(1)                                 # [batch]
loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels)
optimizer.zero_grad()
loss.backward()                                                       # the tables' rows are updated here
optimizer.step()
print(f"loss {loss.item():.4f}; embedding memory {ebc.memory_report()['memory_ratio']:.2f}x less than fp32")
