"""The runner side of a step's images: encode the images the step message lists (one vision-tower
call for them all), keep their embeddings under their content keys, and give the model the step's
(flat rows, embeddings) for the image slices its rows cover. The engine decides what is kept and
when it is dropped (step_planner.py); every rank holds the same entries."""
import numpy as np
import torch

from nanoinfer.multimodal.step_planner import MultiModalStep
from nanoinfer.utils.device_copy import to_device


class EncoderCache:
    def __init__(self, model, device: torch.device):
        self.model = model
        self.device = device
        self.embeddings: dict[int, torch.Tensor] = {}  # key -> [image tokens, hidden]

    @torch.inference_mode()
    def step_embeds(self, step: MultiModalStep) -> tuple[torch.Tensor, torch.Tensor] | None:
        if step.encode:
            pixels = self._pixels_on_device([im.pixel_values for im in step.encode])
            grids = [tuple(im.grid_thw) for im in step.encode]
            for im, emb in zip(step.encode, self.model.encode_images(pixels, grids)):
                self.embeddings[im.key] = emb
        out = None
        if step.placements:
            rows, values = [], []
            for key, first, count, row in step.placements:
                values.append(self.embeddings[key][first:first + count])
                rows.extend(range(row, row + count))
            out = (to_device(rows, torch.int64, self.device), torch.cat(values))
        for key in step.free:
            self.embeddings.pop(key, None)
        return out

    def _pixels_on_device(self, images: list[np.ndarray]) -> torch.Tensor:
        """The images' patches, one after another, on the device. On CUDA they are gathered into
        pinned memory (the caching host allocator keeps it) and copied without a wait: a pageable
        copy of this size would stage through the driver and hold the host."""
        parts = [torch.from_numpy(p) for p in images]
        if self.device.type != "cuda":
            return torch.cat(parts).to(self.device)
        host = torch.empty((sum(p.shape[0] for p in parts), parts[0].shape[1]), dtype=parts[0].dtype, pin_memory=True)
        torch.cat(parts, out=host)
        return host.to(self.device, non_blocking=True)
