"""The engine the scheduler drives: the paged engine (paged.py and the step parts beside it), the synthetic one
(synthetic.py) and the reference one (simple.py), made by factory.py."""
