"""Generated code for the fedlink.v1 wire API. Do not edit."""
