"""The Models page's tiles hold their text at a laptop's width: in a real headless Chromium at 1400 px,
no tile's value runs past the tile's border (the embedded model's sampling defaults are four name-value
pairs, more than a tile's width at the page's large value font). A screenshot goes where the other
browser tests put theirs.

Skips when Chromium or Playwright is missing, unless CI is set: then they are required."""

from __future__ import annotations

import pytest

from tests.dashboard.test_dashboard_browser import (  # noqa: F401  (fixtures: the browser, once per module)
    Visit,
    browser,
    playwright_api,
)
from tests.dashboard.test_models_browser import screenshot
from tests.support.dashboard import make_dashboard_gateway
from tests.support.server import MODEL, running_server

pytestmark = pytest.mark.real_model

# Each value's right edge against its tile's inner right edge, in CSS pixels (> 0: it spills over).
OVERFLOW_JS = """() => [...document.querySelectorAll('.tile')].map(tile => {
  const box = tile.getBoundingClientRect();
  const inner = box.right - parseFloat(getComputedStyle(tile).paddingRight) - parseFloat(getComputedStyle(tile).borderRightWidth);
  const worst = Math.max(...[...tile.children].map(child => child.getBoundingClientRect().right - inner));
  return {label: tile.querySelector('.label')?.textContent, overflow: worst, scroll: tile.scrollWidth - tile.clientWidth};
})"""


@pytest.fixture(scope="module")
def server(browser, smollm2, tmp_path_factory):  # noqa: F811  (no model load when there is no browser)
    gateway = make_dashboard_gateway(tmp_path_factory.mktemp("models-layout-db"))
    with running_server(smollm2, gateway=gateway) as running:
        yield running


def test_no_tile_on_the_models_page_spills_over_at_1400_px(browser, server, tmp_path):  # noqa: F811
    visit = Visit(browser, server)
    try:
        visit.page.set_viewport_size({"width": 1400, "height": 1000})
        visit.log_in()
        visit.page.goto("/admin/models")
        card = f'[data-model="{MODEL}"] [data-field="sampling_defaults"]'
        assert "temperature" in visit.page.inner_text(card)
        screenshot(visit.page, tmp_path, "models-1400.png")
        tiles = visit.page.evaluate(OVERFLOW_JS)
        assert tiles, "no tiles on the page"
        spilling = [tile for tile in tiles if tile["overflow"] > 0.5 or tile["scroll"] > 0]
        assert spilling == [], spilling
    finally:
        visit.context.close()
