"""The CDK app: one stack built from ``shoal.declarations.DEPLOYMENT``."""
