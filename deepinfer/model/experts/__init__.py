"""Mixture of Experts: the sparse layer, its experts over parallel groups, and their placement
(EPLB).
"""
