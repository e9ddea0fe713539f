"""Acceptance counters (vLLM's spec_decode metrics): speculative rows verified ("drafts"), tokens
proposed, tokens accepted, and accepted tokens per proposal position (position i is accepted only
if every proposal before it was)."""


class SpecStats:
    def __init__(self, k: int):
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.accepted_per_position = [0] * k

    def record(self, proposed: int, accepted: int):
        self.num_drafts += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        for i in range(accepted):
            self.accepted_per_position[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / max(self.num_draft_tokens, 1)

    def metrics(self) -> dict[str, float]:
        """name -> value, vLLM's names with our prefix."""
        m = {"nanoinfer:spec_decode_num_drafts": self.num_drafts,
             "nanoinfer:spec_decode_num_draft_tokens": self.num_draft_tokens,
             "nanoinfer:spec_decode_num_accepted_tokens": self.num_accepted_tokens}
        for i, n in enumerate(self.accepted_per_position):
            m[f"nanoinfer:spec_decode_num_accepted_tokens_per_pos[{i}]"] = n
        return m
