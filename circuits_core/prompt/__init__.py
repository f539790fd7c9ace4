"""Prompt-dependent analyses: frozen runs, path expansions, detectors, ablations, model summaries."""
