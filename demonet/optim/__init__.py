"""DeMo's math: chunking, the DCT, top-k payloads, aggregation, the optimizer and its all_gather.

Imports torch only (torch.distributed only in `gather`): no protobuf, grpc, hivemind or asyncio
(tests/unit/test_layering.py checks).
"""

from .aggregate import aggregate, aggregate_clipped, merge_tensor, payload_norm
from .chunking import CHUNK_POLICIES, chunk_shape, chunk_size, reference_chunk_size
from .dct import dct_matrix
from .demo import DeMo
from .gather import gather_payloads
from .options import BASES, DeMoOptions, check_lr
from .payload import ENCODINGS, Compressed, Expected, Payload, matrix_shape, quantize, to_host
from .schedule import SCHEDULES, LrSchedule, check_schedule

__all__ = [
    "BASES", "CHUNK_POLICIES", "ENCODINGS", "SCHEDULES", "Compressed", "DeMo", "DeMoOptions", "Expected", "LrSchedule",
    "Payload",
    "aggregate", "aggregate_clipped", "check_lr", "check_schedule", "chunk_shape", "chunk_size", "dct_matrix",
    "gather_payloads", "matrix_shape", "merge_tensor", "payload_norm", "quantize", "reference_chunk_size", "to_host",
]
