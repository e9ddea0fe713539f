"""The engine side of a step's images: which image slices the step's rows cover, which images the
runners must encode first, which embeddings they may drop, and the rows' rotary positions.

The runners keep each encoded image's embeddings under its content key (encoder_cache.py). Here,
`resident` mirrors what they hold: for each key, the sequences whose prefill still has to pass that
image. A sequence stops holding an image once its computed tokens pass the image's end, or when it is
no longer running (finished, aborted, preempted: a preempted one encodes again when it recomputes).
An image no sequence holds is dropped, in the next step's message. Identical images (the same key)
are encoded once and shared."""
from dataclasses import dataclass

import numpy as np

from nanoinfer.step.sequence import SequenceStatus

# the keys of a step's parts (StepInput.parts): its MultiModalStep, and its rows' rotary positions
# when they are not each row's starts.. ([positions], flat, or [t, h, w]: M-RoPE, image tokens)
IMAGES, ROPE_POSITIONS = "images", "rope_positions"


@dataclass(slots=True)
class ImageToEncode:
    """An image the runner encodes this step (its embeddings are then kept under `key`)."""
    key: int
    pixel_values: object             # numpy float32 [patches, C * T * P * P], as the image processor made them
    grid_thw: tuple[int, int, int]


@dataclass(slots=True)
class MultiModalStep:
    """A step's images (multimodal/step_planner.py): those to encode first; `placements`, per image
    slice the step's rows cover, (key, first embedding row, count, first flat token row); and the
    keys whose embeddings no running prefill needs any more (dropped once the step's are taken)."""
    encode: list[ImageToEncode]
    placements: list[tuple[int, int, int, int]]
    free: list[int]


class MultiModalStepPlanner:
    def __init__(self):
        self.resident: dict[int, dict] = {}  # key -> {sequence: the image's end in it}
        self._last_encoded: list[int] = []   # keys the last planned step asked the runners to encode
        self._last_freed: list[int] = []     # ... and to drop
        self._orphans: set[int] = set()      # keys a step that failed to launch may have left on a runner

    def plan(self, batch) -> tuple[list[list[int]] | None, MultiModalStep | None]:
        """(rope_positions, multi_modal) of a scheduled batch (engine/scheduler.py ScheduledBatch):
        None, None for a batch without multimodal sequences, when no image is held."""
        self._last_encoded, self._last_freed = [], []
        if not self.resident and not self._orphans and all(seq.multi_modal is None for seq in batch.seqs):
            return None, None
        encode, placements = [], []
        flat = 0
        for seq, start, q in zip(batch.seqs, batch.starts, batch.query_lens):
            mm = seq.multi_modal
            for im in (mm.images if mm is not None else ()):
                lo, hi = max(start, im.offset), min(start + q, im.end)
                if lo >= hi:
                    continue
                if im.key not in self.resident:
                    self.resident[im.key] = {}
                    encode.append(ImageToEncode(im.key, im.pixel_values, im.grid_thw))
                self.resident[im.key][seq] = im.end
                placements.append((im.key, lo - im.offset, hi - lo, flat + lo - start))
            flat += q
        free = self._release() + [key for key in self._orphans if key not in self.resident]
        self._orphans.clear()
        self._last_encoded, self._last_freed = [im.key for im in encode], free
        step = MultiModalStep(encode, placements, free) if encode or placements or free else None
        return rope_positions(batch), step

    def unschedule(self):
        """The last planned step was not launched (an exception): the images it asked to encode are
        not held, and those it asked to drop may still be; a runner holding either is told to drop
        them with the next step, unless that step needs them."""
        for key in self._last_encoded:
            self.resident.pop(key, None)
        self._orphans.update(self._last_encoded, self._last_freed)
        self._last_encoded, self._last_freed = [], []

    def _release(self) -> list[int]:
        """Drop holders that no longer need their image; return the keys no one holds."""
        free = []
        for key, holders in list(self.resident.items()):
            for seq, end in list(holders.items()):
                if seq.status != SequenceStatus.RUNNING or seq.num_computed_tokens >= end:
                    del holders[seq]
            if not holders:
                del self.resident[key]
                free.append(key)
        return free


def rope_positions(batch) -> list[list[int]] | None:
    """The rows' rotary positions: None when every row's are its start.. (no request with images);
    one flat list when every token's three M-RoPE positions agree; else three lists."""
    rows = list(zip(batch.seqs, batch.starts, batch.query_lens))
    if all(seq.multi_modal is None for seq, _, _ in rows):
        return None
    if not any(seq.multi_modal is not None and seq.multi_modal.covers_image(start, start + q)
               for seq, start, q in rows):
        flat = []  # (decode steps: a few list operations a row)
        for seq, start, q in rows:
            mm = seq.multi_modal
            flat.extend(range(start, start + q) if mm is None else mm.text_positions(start, start + q))
        return [flat]
    parts = [np.broadcast_to(np.arange(start, start + q), (3, q)) if seq.multi_modal is None
             else seq.multi_modal.rope_positions(start, start + q) for seq, start, q in rows]
    return np.concatenate(parts, axis=1).tolist()
