"""The step vocabulary, below the engine and every feature: plain data that the scheduler, the
runner, sampling and the features all speak (a Sequence, the typed step message), and the
seams: the feature hooks (feature.py) and the plain row planner (row_planner.py). It imports no
other part of nanoinfer but the user's SamplingParams."""
