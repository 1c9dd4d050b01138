"""A model's forward pass over a rollout batch: the final hidden states that predict each response
token. The student's (for the loss), the in-process teacher's (for its scores) and the served
teacher's chunking all read it from here.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from opd.models.loading import final_hidden
from opd.models.sharding import in_lockstep
from opd.rollout.sampling import RolloutBatch

# Rows per forward chunk in response_hidden. A batch padded to its longest prompt and longest
# response is mostly padding when lengths vary; chunks of rows of similar length, each cut to its
# own longest prompt and response, skip most of it, while chunks too small leave the matrix
# products narrow. How the value was chosen is in docs/benchmarks.md ("Where opd's step goes").
ROWS_PER_CHUNK = 8


def response_hidden(model: PreTrainedModel, batch: RolloutBatch, rows_per_chunk: int = ROWS_PER_CHUNK) -> torch.Tensor:
    """Final hidden states that predict each response token: position P - 1 + t predicts y_t.

    Rows are run in chunks of similar length, each trimmed of the padding all its rows share.
    Positions outside ``response_mask_NT`` hold no meaningful value (zeros past the longest
    response of the row's chunk): every consumer masks them. The number of forwards follows the rows: a
    sharded model's ranks are kept in step (:func:`opd.models.sharding.in_lockstep`).

    Shapes: returns (N, T, D)
    """
    return in_lockstep(model, lambda: _by_chunks(model, batch, rows_per_chunk))


def _by_chunks(model: PreTrainedModel, batch: RolloutBatch, rows_per_chunk: int) -> torch.Tensor:
    P, T = batch.prompt_len, batch.response_ids_NT.shape[1]
    prompt_lens_N = batch.attention_mask_NL[:, :P].sum(-1)
    response_lens_N = batch.response_mask_NT.sum(-1).clamp(min=1)
    order_N = torch.argsort(prompt_lens_N + response_lens_N, stable=True)
    pieces = []
    for rows in order_N.split(rows_per_chunk):
        start, t_max = P - int(prompt_lens_N[rows].max()), int(response_lens_N[rows].max())
        # the last response token is never an input that predicts one, so the slice stops before it
        h = final_hidden(
            model, batch.input_ids_NL[rows, start : P + t_max - 1], batch.attention_mask_NL[rows, start : P + t_max - 1]
        )
        h = h[:, P - 1 - start : P - 1 - start + t_max]
        pieces.append(torch.nn.functional.pad(h, (0, 0, 0, T - t_max)))
    return torch.cat(pieces)[torch.argsort(order_N)]
