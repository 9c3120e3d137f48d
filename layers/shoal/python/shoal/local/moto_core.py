"""moto adapted process-wide where no one service's module is the place (``shoal.local.aws``
applies these with the services' own, idempotent): botocore's service models loaded once for
the process, moto's model instances not kept for its dashboard, moto's Lambda triggers kept
off the queues and streams the emulated mappings read."""

from __future__ import annotations

import threading
from typing import Any


def share_service_models() -> None:
    """One botocore model loader, model and TLS context per process, whatever the number of
    boto3 sessions.

    Each new boto3 session parses the service models it makes clients of again (megabytes of
    JSON). Deployed, a function makes one session for its life (``shoal.aws.clients``); but
    ``shoal dev`` and the tests make a fresh account, and so fresh sessions, again and again:
    profiled, a worker of the suite spent half its time parsing the same models. The models
    are read-only once loaded, so one loader per search path serves every session.
    """
    import botocore.loaders
    import botocore.session

    if getattr(botocore.session.create_loader, "shoal_shared", False):
        return
    make = botocore.loaders.create_loader
    loaders: dict[str, botocore.loaders.Loader] = {}
    lock = threading.Lock()

    def shared(search_path_string: str | None = None) -> botocore.loaders.Loader:
        with lock:
            key = search_path_string or ""
            if key not in loaders:
                loaders[key] = make(search_path_string)
            return loaders[key]

    shared.shoal_shared = True  # type: ignore[attr-defined]
    botocore.session.create_loader = shared

    # A client's service model resolves each operation's shapes on first use (profiled: most of
    # a fresh client's first calls); a model made once per loaded model keeps that work.
    import botocore.client
    import botocore.model

    models: dict[tuple[int, str], botocore.model.ServiceModel] = {}

    def service_model(
        creator: botocore.client.ClientCreator, service_name: str, api_version: str | None = None
    ) -> botocore.model.ServiceModel:
        loader = vars(creator)["_loader"]  # botocore keeps it private
        document = loader.load_service_model(service_name, "service-2", api_version=api_version)
        # the shared loader caches the document: its identity names one model for the process
        key = (id(document), service_name)
        with lock:
            if key not in models:
                models[key] = botocore.model.ServiceModel(document, service_name=service_name)
            return models[key]

    botocore.client.ClientCreator._load_service_model = service_model  # type: ignore[attr-defined]

    # Each client's HTTP session makes an SSL context, and OpenSSL 3 makes one slowly: profiled
    # on CI's machine, a sixth of an integration test's time went into contexts for emulated
    # endpoints that never speak TLS. One context serves every client; botocore changes a
    # context only for a proxy's own TLS settings, and those sessions still get their own.
    import botocore.httpsession

    session_class = botocore.httpsession.URLLib3Session
    make_context = session_class._get_ssl_context  # type: ignore[attr-defined]
    contexts: list[Any] = []

    def ssl_context(session: botocore.httpsession.URLLib3Session) -> Any:
        proxy = vars(session)["_proxy_config"].settings
        if proxy.get("proxy_ca_bundle") is not None or proxy.get("proxy_client_cert") is not None:
            return make_context(session)
        with lock:
            if not contexts:
                contexts.append(make_context(session))
            return contexts[0]

    session_class._get_ssl_context = ssl_context  # type: ignore[attr-defined]


def forget_model_instances() -> None:
    """Stop moto from keeping every model object it ever made (process-wide, idempotent).

    moto's ``BaseModel.__new__`` appends each instance to its class's ``instances_tracked``
    for the moto server's dashboard (``/moto-api/data.json``) and never lets go: every
    DynamoDB ``Item`` a put, an update or a query's deep copy of its answer makes, every Kinesis
    record, every CloudWatch datum lived as long as the process. ``python -m bench soak``
    found it (issue 47): ``shoal dev`` grew by about 30 MB a minute at 25 deliveries a second,
    16,000 ``Item`` objects in 45 s of which 680 were in a table. Nothing of Shoal reads the
    dashboard; its model lists now stay empty, and those kept so far are let go.
    """
    from moto.core import common_models
    from moto.core.model_instances import reset_model_data

    if getattr(common_models.BaseModel.__new__, "_untracked", False):
        return

    def untracked(cls: type, *args: Any, **kwargs: Any) -> Any:
        return object.__new__(cls)

    untracked._untracked = True  # type: ignore[attr-defined]
    common_models.BaseModel.__new__ = staticmethod(untracked)
    reset_model_data()


def detach_moto_lambda_triggers() -> None:
    """Stop moto from running functions for stream records itself (process-wide, idempotent).

    On every PutRecord(s) to a stream with an event source mapping (and every DynamoDB stream
    record) moto tries to invoke the function in Docker, which is not here: each attempt costs
    ~0.5 s inside the backend lock and then fails. The local runtime delivers those records
    itself (``shoal.local.esm``); moto only needs to store the mappings.
    """
    from moto.awslambda.models import LambdaBackend

    def no_delivery(self: Any, *args: Any, **kwargs: Any) -> None:
        return None

    LambdaBackend.send_kinesis_message = no_delivery
    LambdaBackend.send_dynamodb_items = no_delivery
    # a queue's mapping is kept by moto on the queue, and every send would receive the
    # message for it (counting a receive) before failing to invoke: the queue keeps none
    from moto.sqs.models import Queue

    Queue.lambda_event_source_mappings = property(lambda self: {}, lambda self, value: None)


def draw_request_ids_cheaply() -> None:
    """moto's request ids (``x-amzn-requestid``) drawn as 52 characters at once, not one at a
    time (process-wide, idempotent).

    moto draws each of a request id's 52 characters with its own ``random.choice``: 52 Python
    calls on every answer, about a twentieth of an in-process GetItem's CPU (cProfile,
    2026-12-06). Nothing reads the id but a person: what it is drawn from does not matter, and
    the journal's replay does not depend on it either (moto's generator is seeded again for
    each record before its action runs, and the id is drawn after it).
    """
    import os

    from moto.core import responses

    if getattr(responses.gen_amzn_requestid_long, "shoal_cheap", False):
        return

    def request_id(headerdict: dict[str, Any] | None = None) -> str:
        drawn = os.urandom(26).hex().upper()
        if isinstance(headerdict, dict):
            headerdict["x-amzn-requestid"] = drawn
        return drawn

    request_id.shoal_cheap = True  # type: ignore[attr-defined]
    responses.gen_amzn_requestid_long = request_id


def pick_members_by_known_keys() -> None:
    """moto's serializer finds a structure member's value in a plain dict by the keys it
    worked out the first time for that member, not again on every answer (process-wide,
    idempotent).

    moto's serializer writes an answer by walking the output shape; for each member of each
    structure it asks its attribute picker for the member's value, and the picker builds an
    instance of each of its five alias providers to list the keys the value may be under (the
    model's name, a serialization alias, names with a prefix cut, each also in snake case),
    then tries them in turn. Every member is picked so, present or not: a Kinesis record has
    five, a batch read's consumed capacity seven. In a fan-out to 1,000 WebSocket subscribers
    under ``shoal dev`` (py-spy ``--gil``, 2026-12-07) the picks were 7 % of the process's time.

    For a plain dict (what moto's DynamoDB, Kinesis and SQS handlers answer with) the keys
    depend on the member's name and shape (and the structure holding it) only, never on the
    dict's content: the aliases that read the value (its ``Meta`` aliases, its class name) see
    the same ``dict`` every time. So they are listed once per member shape and tried in the
    same order; the first found is the value, as before. Anything else (an object, a picker
    with response transformers) is picked the way moto picks it.
    """
    from moto.core import serialize
    from moto.core.utils import MISSING, get_value

    serializer = serialize.ResponseSerializer
    if getattr(serializer.get_value, "shoal_known_keys", False):
        return
    original = serializer.get_value
    #: (member name, member shape, the structure holding it) -> the keys its value may be
    #: under, in the picker's order (shapes live as long as the shared service models)
    known: dict[tuple[str, Any, Any], tuple[str, ...]] = {}
    pickers = (serialize.AttributePicker, serialize.XFormedAttributePicker)

    def get_value_by_known_keys(self: Any, value: Any, key: str, shape: Any) -> Any:
        picker = self._value_picker
        if type(value) is not dict or type(picker) not in pickers or picker.response_transformers:
            return original(self, value, key, shape)
        member = (key, shape, getattr(shape, "parent", None))
        keys = known.get(member)
        if keys is None:
            context = serialize.AttributePickerContext(
                obj=value,
                key=key,
                shape=shape,
                operation_model=self.operation_model,
                service_model=self.operation_model.service_model,
            )
            keys = known.setdefault(member, tuple(picker.get_possible_keys(context)))
        for possible in keys:
            found = get_value(value, possible, MISSING)
            if found is not MISSING:
                return found
        return None

    get_value_by_known_keys.shoal_known_keys = True  # type: ignore[attr-defined]
    get_value_by_known_keys.shoal_moto = original  # type: ignore[attr-defined]
    serializer.get_value = get_value_by_known_keys
