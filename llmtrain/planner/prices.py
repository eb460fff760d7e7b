"""Prices per instance-hour: a dated table shipped as data, refreshed from the AWS Price List API.

`prices.json` (beside this module) holds on-demand SageMaker training prices for one region, where
they came from and when. `refresh` replaces them with the Price List API's (the `pricing` client's
GetProducts for service AmazonSageMaker, component Training; the API answers in us-east-1 and
ap-south-1 for every region). Spot: SageMaker publishes no spot price; managed spot training bills
the on-demand price for fewer billable seconds, so a run's spot cost is its on-demand cost times
`1 - spot_savings_assumed` until it ran, and billable seconds x on-demand price after.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmtrain.core.errors import LlmtrainError

PRICE_TABLE = Path(__file__).resolve().parent / "prices.json"
SERVICE_CODE = "AmazonSageMaker"
PRICING_API_REGION = "us-east-1"
API_SOURCE = "AWS Price List API (GetProducts, AmazonSageMaker, component Training)"


class PriceError(LlmtrainError):
    """A price the table lacks, or a table that cannot be read or refreshed."""


@dataclass(frozen=True)
class PriceTable:
    region: str
    currency: str
    source: str
    retrieved: str
    spot_savings_assumed: float
    on_demand_per_hour: Mapping[str, float]
    about: str = ""

    def on_demand(self, instance_type: str) -> float:
        try:
            return self.on_demand_per_hour[instance_type]
        except KeyError:
            raise PriceError(
                f"the price table ({self.region}, {self.retrieved}) has no price for "
                f"{instance_type}; run `llmtrain prices refresh`"
            ) from None

    def per_hour(self, instance_type: str, *, spot: bool) -> float:
        price = self.on_demand(instance_type)
        return price * (1 - self.spot_savings_assumed) if spot else price

    def describe(self) -> str:
        origin = "Price List API" if self.source.startswith("AWS Price List API") else "manual table"
        return f"{self.currency} {self.region} on-demand, {origin} of {self.retrieved}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "about": self.about,
            "source": self.source,
            "retrieved": self.retrieved,
            "region": self.region,
            "currency": self.currency,
            "spot_savings_assumed": self.spot_savings_assumed,
            "on_demand_per_hour": dict(sorted(self.on_demand_per_hour.items())),
        }


def load(path: Path = PRICE_TABLE) -> PriceTable:
    try:
        data = json.loads(Path(path).read_text())
        return PriceTable(
            region=data["region"],
            currency=data["currency"],
            source=data["source"],
            retrieved=data["retrieved"],
            spot_savings_assumed=float(data["spot_savings_assumed"]),
            on_demand_per_hour={k: float(v) for k, v in data["on_demand_per_hour"].items()},
            about=data.get("about", ""),
        )
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise PriceError(f"cannot read the price table {path}: {error}") from error


def write(table: PriceTable, path: Path = PRICE_TABLE) -> None:
    Path(path).write_text(json.dumps(table.to_dict(), indent=2) + "\n")


# --- refresh from the Price List API ---------------------------------------------------------------


def fetch_on_demand(pricing_client, region: str, instance_types: Iterable[str]) -> dict[str, float]:
    """On-demand USD per hour of SageMaker training instances in `region`, from GetProducts."""
    wanted = set(instance_types)
    filters = [
        {"Type": "TERM_MATCH", "Field": "regionCode", "Value": region},
        {"Type": "TERM_MATCH", "Field": "component", "Value": "Training"},
    ]
    found: dict[str, float] = {}
    paginator = pricing_client.get_paginator("get_products")
    for page in paginator.paginate(ServiceCode=SERVICE_CODE, Filters=filters, FormatVersion="aws_v1"):
        for item in page["PriceList"]:
            product = json.loads(item) if isinstance(item, str) else item
            name, price = _training_price(product)
            if name in wanted and price is not None:
                found[name] = price
    return found


def _training_price(product: Mapping[str, Any]) -> tuple[str | None, float | None]:
    attributes = product.get("product", {}).get("attributes", {})
    name = attributes.get("instanceName") or attributes.get("instanceType", "")
    name = name.removesuffix("-Training")
    for term in product.get("terms", {}).get("OnDemand", {}).values():
        for dimension in term.get("priceDimensions", {}).values():
            usd = dimension.get("pricePerUnit", {}).get("USD")
            if usd is not None and dimension.get("unit", "Hrs").lower().startswith("hr"):
                return name, float(usd)
    return name, None


def refresh(
    pricing_client, table: PriceTable, region: str | None = None, today: datetime.date | None = None
) -> tuple[PriceTable, list[str]]:
    """A new table with every instance type of `table` priced from the API, and the types the API
    did not price (they keep no price: a plan for them says to refresh again)."""
    region = region or table.region
    prices = fetch_on_demand(pricing_client, region, table.on_demand_per_hour)
    if not prices:
        raise PriceError(
            f"the Price List API returned no SageMaker training prices for {region}: "
            "check the region name and that the credentials allow pricing:GetProducts"
        )
    missing = sorted(set(table.on_demand_per_hour) - set(prices))
    refreshed = PriceTable(
        region=region,
        currency="USD",
        source=API_SOURCE,
        retrieved=(today or datetime.date.today()).isoformat(),
        spot_savings_assumed=table.spot_savings_assumed,
        on_demand_per_hour=prices,
        about=table.about,
    )
    return refreshed, missing
