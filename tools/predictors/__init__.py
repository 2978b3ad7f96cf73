"""Where a predictor profile comes from (docs/predictors.md): ``calibrate`` measures a running
instance into benchmark tables (``tables``), ``refit`` fits the tables into a profile by least
squares (``fitting``). The profile they write is what proxy_workers/predictors/ evaluates.
"""
