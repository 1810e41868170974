"""Procedural compositional scenes (GenEval at toy scale): templated prompts, PIL renders and a rule-based verifier."""
