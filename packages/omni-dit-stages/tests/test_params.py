"""A request's image fields: parsed once by plan, read back by the stages after it."""

from __future__ import annotations

import pytest
from omni_dit.params import (
    ImageParams,
    ImageRequestError,
    forwarded_params,
    params_payload,
    parse_image_request,
)


def test_parsed_params_travel_as_they_were_parsed():
    request = {"prompt": "x", "image": {"width": 64, "steps": 3, "format": "png"}}
    params = parse_image_request(request, 16, 1 << 20, 10, {"height": 32, "seed": 7})
    assert params == ImageParams(width=64, height=32, steps=3, seed=7, format="png")
    payloads = [{"other": 1}, params_payload(params)]
    assert forwarded_params(payloads) == params


def test_no_params_from_upstream_is_a_request_error():
    with pytest.raises(ImageRequestError, match="is plan before this stage"):
        forwarded_params([{"image": {"width": 64}}])


@pytest.mark.parametrize(
    ("image", "field"),
    [({"width": 65}, "image.width"), ({"steps": 11}, "image.steps"), ({"x": 1}, "image.x")],
)
def test_plan_names_the_bad_field(image, field):
    with pytest.raises(ImageRequestError, match=f"field '{field}'"):
        parse_image_request({"image": image}, 16, 1 << 20, 10)
