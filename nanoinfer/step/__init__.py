"""The step vocabulary, below the engine and every feature: plain data that the scheduler, the
runner, sampling and the features all speak (a Sequence, the typed step message). It imports no
other part of nanoinfer but the user's SamplingParams."""
