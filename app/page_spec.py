"""The page a declared analysis asks for (its `page=` field, app/analysis.py): a template of its own, or the shared
page of one number per head. app/routers/declared_pages.py turns each into a `Page` (app/routers/rendering.py), so
an analysis with a page needs no line in app/routers/pages.py.

`nav` is the page's place in a model's left navigation: the labelled pages are listed in ascending `nav`, labelled
with the analysis's `summary` (app/routers/pages.py numbers its own pages on the same scale, in tens: 10 the
overview ... 140 the residual stream's usage; pick a free number between two neighbours). None: no navigation entry
(a page reached by links, e.g. one pair of heads).

`head_filter` is the page's hook for the head filter (app/head_filter.py): a page that lists or plots every head
names here what the filter restricts ("the heat map colours and the table lists"); the page then takes a `filter`
parameter beside its analysis's, and its template gets the heads the filter keeps (`kept`) and the filter's note
(app/routers/declared_pages.py `head_filter_context`). None: the page has no head filter."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class OwnPage:
    """A page with its own template (templates/<template>): it gets the analysis's view as `view`, its refusal as
    `error`, the params as `params`, beside the page frame (rendering.Page says which names)."""

    template: str
    nav: int | None = None
    head_filter: str | None = None  # what the head filter restricts on the page (None: no head filter)


@dataclass(frozen=True, kw_only=True)
class PerHeadPage:
    """The shared page of an analysis whose view holds one number per head, `[layer][head]`: a heatmap of layers
    by heads and a table of every head (linking its head page), under the caption "(basis: the model's weights as
    served)" (templates/per_head.html). No template file of its own. For an analysis without parameters (NoParams:
    the page has no form), whose view has the `values` field; app/routers/declared_pages.py refuses others at start."""

    values: str  # the view's field holding the [layer][head] numbers (list[list[float]])
    title: str  # the page's heading
    explanation: str  # the paragraph under the heading: what the number is and how it is computed
    quantity: str  # the number's name: the heatmap's title and the table's column
    digits: int = 4  # digits shown in the table
    nav: int | None = None
    # what the head filter restricts: every head's page can be filtered (None: not)
    head_filter: str | None = "the heat map colours and the table lists only these"
    template: str = "per_head.html"


PageSpec = OwnPage | PerHeadPage
