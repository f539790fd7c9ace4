"""The paper tour: figures of the paper computed on the shipped models (tour.py), with their measured claims
(claims.py and residual.py, their values typed in paper_claims.py), figure builders (figures.py) and chapters
(rotary.py with rotary_claims.py, gemma3.py, each claim typed). It composes the views' answers (app/views/), so it
sits above them (make lint: lint-imports)."""
