"""Testing helpers: the pytest plugin (``@pytest.mark.xds``) and reference scenarios."""
