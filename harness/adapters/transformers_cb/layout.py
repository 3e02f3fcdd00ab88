"""transformers CB's paged layout, read from a forward's keyword arguments and its cache allocator.

transformers packs the scheduled requests' tokens into one flat batch (`input_ids` `[1, N]`,
`position_ids`, `cu_seq_lens_q`/`cu_seq_lens_k`) and keeps K/V in pages of `page_size` tokens
(a block: one page per layer), written at the cache's `write_index` and read back through its
`read_index`, both physical row numbers. `packed` turns them into `running.paged.PagedCall`'s
fields (vLLM's slot mapping and block table), so both paged engines are judged by the same rules.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Layout:
    """How a full-attention allocator lays a block out: `stride` rows per block (keys and values
    of every layer, `block_size` each), the first two sectors' blocks being trash."""

    block_size: int
    stride: int
    first_block: int  # the first block id outside the trash sectors

    @classmethod
    def of(cls, allocator: Any) -> Layout:
        return cls(allocator.tokens_per_page, allocator.block_physical_stride, 2 * allocator.blocks_per_sector)

    def slot(self, row: int) -> int:
        """A physical write row as block * block_size + offset (-1: the trash, or not a layer-0 key row)."""
        block, offset = divmod(row, self.stride)
        return block * self.block_size + offset if offset < self.block_size and block >= self.first_block else -1

    def slots(self, rows: torch.Tensor) -> torch.Tensor:
        """[N] physical write rows -> [N] slots (`slot`)."""
        return torch.tensor([self.slot(int(r)) for r in rows], dtype=torch.long)

    def read_table(
        self, tables: list[list[int]], reads: torch.Tensor, kv_starts: torch.Tensor, seq_lens: torch.Tensor
    ) -> torch.Tensor:
        """[R, max_blocks] each request's blocks as this forward reads them: block j is the one its
        read of position j * B falls in, -1 where a position of it is read from anywhere else
        (the allocator's table when the forward reads nothing: a batch of whole prefills)."""
        if reads.numel() == 0:
            rows = [list(t) for t in tables]
        else:
            rows = [self._read_blocks(reads[int(kv_starts[r]) : int(kv_starts[r + 1])]) for r in range(len(tables))]
        width = max([len(r) for r in rows] + [1])
        return torch.tensor([r + [-1] * (width - len(r)) for r in rows], dtype=torch.long)

    def _read_blocks(self, reads: torch.Tensor) -> list[int]:
        """[seq_len] one request's read rows -> its blocks, one per `block_size` positions (-1: irregular)."""
        blocks = []
        for start in range(0, reads.numel(), self.block_size):
            chunk = reads[start : start + self.block_size].tolist()
            block = chunk[0] // self.stride
            regular = all(row == block * self.stride + i for i, row in enumerate(chunk))
            blocks.append(block if regular and block >= self.first_block else -1)
        return blocks

    def _rows(self, allocator: Any) -> torch.Tensor:
        """[total_rows, kv_heads, head_dim] the allocator's cache, one row per (token, K or V, layer)."""
        cache = allocator.cache_tensor
        return cache.view(-1, cache.shape[-2], cache.shape[-1])

    def block(self, allocator: Any, block: int) -> torch.Tensor:
        """[stride, kv_heads, head_dim] a whole block (every layer's keys and values)."""
        return self._rows(allocator)[block * self.stride : (block + 1) * self.stride].detach().cpu()

    def written_kv(self, allocator: Any, writes: torch.Tensor, layers: Sequence[int]) -> torch.Tensor:
        """[N, L', 2, kv_heads, head_dim] the K/V each packed token left in the cache, read back."""
        rows, per_layer = self._rows(allocator), []
        for layer in layers:
            i = allocator.layer_indices.index(layer)
            keys = rows[writes + 2 * i * self.block_size]  # [N, kv_heads, head_dim]
            values = rows[writes + (2 * i + 1) * self.block_size]
            per_layer.append(torch.stack([keys, values], dim=1))
        return torch.stack(per_layer, dim=1).detach().cpu().clone()


def packed(kwargs: dict, allocator: Any, engine_ids: list[str]) -> dict[str, Any]:
    """A forward's packed layout from its keyword arguments (R requests, N tokens), as `PagedCall`
    fields; the slots of its writes and the blocks of its reads in the allocator's layout. The
    private `_layout`, `_allocator` and `_writes` are for the observer's after-forward half."""
    rows = len(engine_ids)
    qsl = kwargs["cu_seq_lens_q"][: rows + 1].detach().cpu().long().clone()  # [R + 1]
    n = int(qsl[-1])
    kv_starts = kwargs["cu_seq_lens_k"]["full_attention"][: rows + 1].detach().cpu().long()  # [R + 1]
    seq_lens = (kv_starts[1:] - kv_starts[:-1]).clone()  # [R]
    layout = Layout.of(allocator)
    writes = kwargs["write_index"][allocator.index][:n].detach().cpu().long()  # [N] physical rows
    reads = kwargs["read_index"][allocator.index].detach().cpu().long()  # [sum seq_lens], or empty: nothing read
    tables = [allocator.block_table.get(r, []) for r in engine_ids]
    return dict(
        input_ids=kwargs["input_ids"][0, :n].detach().cpu().long().clone(),  # [N]
        positions=kwargs["position_ids"][0, :n].detach().cpu().long().clone(),  # [N]
        query_start_loc=qsl,
        seq_lens=seq_lens,
        slot_mapping=layout.slots(writes),  # [N]
        block_table=layout.read_table(tables, reads, kv_starts, seq_lens),  # [R, max_blocks]
        block_size=layout.block_size,
        _layout=layout,
        _allocator=allocator,
        _writes=writes,
    )
