"""Offline tools: run by hand from the checkout, never by a running role (tests/test_layout.py
holds the product to that). ``tools.predictors`` measures an instance and fits a predictor
profile from the measurements; the workers only read the profile (proxy_workers/predictors/).
"""
