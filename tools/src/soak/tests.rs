//! Unit tests of the soak: its checksums, counts, reports and flags.

use super::*;

#[test]
fn checksum_catches_every_single_bit_flip() {
    let body = make_body(42, 300, 7);
    let flat: Vec<u8> = body.segments().iter().flat_map(|s| s.to_vec()).collect();
    assert_eq!(check_body(&flat), Some(42));
    for bit in 0..flat.len() * 8 {
        let mut b = flat.clone();
        b[bit / 8] ^= 1 << (bit % 8);
        assert_ne!(check_body(&b), Some(42), "bit {bit} undetected");
    }
}

#[test]
fn seq_tracking_counts_reorders_and_duplicates() {
    let mut t = SeqTrack::default();
    let mut c = Counts::default();
    for s in [0, 1, 3, 2, 4, 4] {
        t.see(s, &mut c);
    }
    assert_eq!(c.out_of_order, 1);
    assert_eq!(c.duplicated, 1);
}

fn response(id: u64, status: Status, body: &[u8]) -> Incoming<'_> {
    Incoming::Response {
        id,
        opcode: Opcode::Rpc,
        status,
        body,
    }
}

/// `body` as one slice.
fn flat(body: &Payload) -> Vec<u8> {
    body.segments().iter().flat_map(|s| s.to_vec()).collect()
}

/// The payload bytes of the request [`answer`] answers.
const REQUEST_BYTES: u64 = 116;

/// One answer to request 7 (seq 0, [`REQUEST_BYTES`] of payload)
/// checked by a client, on `c`.
fn answer(c: &mut Counts, server_here: bool, status: Status, body: &[u8]) {
    answer_at(c, server_here, status, body, Instant::now());
}

/// [`answer`], received at `now`, the request sent at `now`.
fn answer_at(c: &mut Counts, server_here: bool, status: Status, body: &[u8], now: Instant) {
    answer_sent_at(c, server_here, status, body, now, now);
}

/// [`answer`], the request sent at `sent`, its answer received at
/// `now`: the round trip [`on_response`] gives.
fn answer_sent_at(
    c: &mut Counts,
    server_here: bool,
    status: Status,
    body: &[u8],
    sent: Instant,
    now: Instant,
) -> Option<Duration> {
    let pending = Pending {
        seq: 0,
        bytes: REQUEST_BYTES,
        sent,
    };
    let mut outstanding = HashMap::from([(7, pending)]);
    c.messages += 1;
    on_response(
        &mut outstanding,
        &mut SeqTrack::default(),
        c,
        server_here,
        response(7, status, body),
        now,
    )
}

/// Every answered request gives its round trip, from the turn that
/// sent it to the one that got its answer, whatever the answer says
/// (each is in `answered`, which `msgs_per_s` and `latency_us.count`
/// count); an answer no request waits for gives none.
#[test]
fn every_answered_request_gives_its_round_trip() {
    let t0 = Instant::now();
    let at = |us| t0 + Duration::from_micros(us);
    let ok = flat(&make_body(0, 100, 3));
    let mut c = Counts::default();
    let mut trips = RoundTrips::default();
    for (status, body, us) in [
        (Status::Ok, &ok[..], 40),
        (Status::Ok, &ok[..], 250),
        (Status::BadRequest, &[][..], 90),
        (Status::UnknownVariable, &ok[..], 1000),
    ] {
        let rtt = answer_sent_at(&mut c, true, status, body, at(10), at(10 + us));
        assert_eq!(rtt, Some(Duration::from_micros(us)), "{status:?}");
        trips.record(rtt.unwrap());
    }
    let stray = on_response(
        &mut HashMap::new(),
        &mut SeqTrack::default(),
        &mut c,
        true,
        response(9, Status::Ok, &ok),
        at(5000),
    );
    assert_eq!(stray, None);
    let l = trips.latency();
    assert_eq!(l.count, c.answered);
    assert_eq!(c.answered, 4);
    assert!((l.max - 1000.0).abs() <= 1.0, "{l:?}");
    assert!(l.p50 <= l.p99 && l.p99 <= l.max, "{l:?}");
    // A clock that went back (turns of one reactor do not): 0, not a
    // panic.
    assert_eq!(
        answer_sent_at(&mut c, true, Status::Ok, &ok, at(10), at(5)),
        Some(Duration::ZERO)
    );
}

/// `--max-latency-ms`: parsed in milliseconds; 0, negative, NaN and
/// infinite bars are usage errors naming the flag; a `--listen`
/// server, which measures no round trips, refuses it.
#[test]
fn max_latency_ms_is_parsed_and_refused_where_it_cannot_work() {
    assert_eq!(soak_args(&[]).max_latency_ms, None);
    assert_eq!(
        soak_args(&["--max-latency-ms", "2.5"]).max_latency_ms,
        Some(2.5)
    );
    #[derive(clap::Parser, Debug)]
    struct Cli {
        #[command(flatten)]
        soak: SoakArgs,
    }
    for bad in ["0", "-1", "nan", "inf", "1e400", "fast"] {
        let e = <Cli as clap::Parser>::try_parse_from(["soak", &format!("--max-latency-ms={bad}")])
            .expect_err(bad);
        assert_eq!(e.exit_code(), 2, "{bad}: {e}");
        assert!(e.to_string().contains("--max-latency-ms"), "{bad}: {e}");
    }
    let listen = soak_args(&["--listen", "127.0.0.1:0", "--max-latency-ms", "5"]);
    let e = validate(&listen).expect_err("a --listen server measures no round trips");
    assert!(e.contains("--max-latency-ms"), "{e}");
    let connect = soak_args(&["--connect", "127.0.0.1:1", "--max-latency-ms", "5"]);
    assert_eq!(validate(&connect), Ok(()));
}

/// The text report's latency line has every figure, and the bar in
/// microseconds when there is one.
#[test]
fn the_latency_line_has_every_figure_and_the_bar() {
    let l = LatencyUs {
        p50: 21.3,
        p99: 40.0,
        p999: 52.5,
        max: 60.0,
        count: 1234,
    };
    let s = latency_line(&l, None);
    assert_eq!(
        s,
        "p50 21.3 us, p99 40.0 us, p99.9 52.5 us, max 60.0 us over 1234 round trips"
    );
    let s = latency_line(&l, Some(0.5));
    assert!(
        s.ends_with("(--max-latency-ms 0.5: p99 at most 500.0 us)"),
        "{s}"
    );
}

/// Each answer adds its request's payload bytes and its own, and ends
/// the client's span no earlier than its arrival; an answer no
/// request waits for adds nothing. The report's throughput is the
/// client's: beside it, the server's bytes and span are left out, as
/// its requests are.
#[test]
fn answers_count_their_payload_bytes_over_the_clients_span() {
    let t0 = Instant::now();
    let at = |ms| t0 + Duration::from_millis(ms);
    let ok = flat(&make_body(0, 100, 3));
    let mut client = Counts::default();
    client.span.begin(t0);
    answer_at(&mut client, true, Status::Ok, &ok, at(250));
    answer_at(&mut client, true, Status::BadRequest, &[], at(500));
    assert_eq!(client.answered, 2);
    assert_eq!(
        client.payload_bytes,
        2 * REQUEST_BYTES + ok.len() as u64,
        "a refusal's request counts, its empty body adds nothing"
    );
    // An answer to no pending request: no bytes, no later end.
    on_response(
        &mut HashMap::new(),
        &mut SeqTrack::default(),
        &mut client,
        true,
        response(9, Status::Ok, &ok),
        at(900),
    );
    assert_eq!((client.answered, client.duplicated), (2, 1));
    let server = Counts {
        messages: 2,
        answered: 2,
        payload_bytes: 1 << 30,
        span: {
            let mut s = Span::default();
            s.begin(at(1));
            s.extend_to(at(4000));
            s
        },
        ..Counts::default()
    };
    let mut report = client;
    report.add_server(&server);
    let t = report.throughput();
    assert_eq!(t.measured_s, 0.5);
    assert_eq!(t.msgs_per_s, 4.0);
    assert_eq!(
        t.gbps,
        (2 * REQUEST_BYTES + ok.len() as u64) as f64 * 16.0 / 1e9
    );
}

/// A status garbled on the way (the frame header has no checksum)
/// fails the soak even where no server counts a rejection: a client
/// in a process of its own.
#[test]
fn a_response_that_is_not_ok_is_counted_rejected_and_fails() {
    let body = flat(&make_body(0, 100, 3));
    for server_here in [false, true] {
        for status in [Status::BadRequest, Status::UnknownVariable] {
            let mut c = Counts::default();
            answer(&mut c, server_here, status, &body);
            assert_eq!(
                (c.answered, c.rejected, c.refused, c.corrupted),
                (1, 1, 0, 0),
                "{status:?}, server here: {server_here}"
            );
            assert!(!c.clean(), "{status:?} passed");
        }
        // The same answer with its status intact passes.
        let mut c = Counts::default();
        answer(&mut c, server_here, Status::Ok, &body);
        assert_eq!((c.answered, c.rejected), (1, 0));
        assert!(c.clean());
    }
}

/// The server's refusal (`BadRequest`, no body) is `rejected` for a
/// client in a process of its own, which alone reports it; with the
/// server here, which counts it in `corrupted`, it is `refused`.
/// Either way the soak fails.
#[test]
fn a_refusal_is_rejected_by_a_client_alone_and_refused_beside_its_server() {
    assert!(is_refusal(Status::BadRequest, &[]));
    assert!(!is_refusal(Status::UnknownVariable, &[]));
    assert!(!is_refusal(Status::BadRequest, &flat(&make_body(0, 0, 1))));
    for (server_here, rejected, refused) in [(false, 1, 0), (true, 0, 1)] {
        let mut c = Counts::default();
        answer(&mut c, server_here, Status::BadRequest, &[]);
        assert_eq!(
            (c.answered, c.rejected, c.refused, c.corrupted),
            (1, rejected, refused, 0),
            "server here: {server_here}"
        );
        assert!(!c.clean(), "server here: {server_here}");
    }
}

/// The value of `starwire_soak_messages_total{outcome}` in `scrape`.
fn scraped(scrape: &str, outcome: &str) -> u64 {
    let series = format!("starwire_soak_messages_total{{outcome=\"{outcome}\"}} ");
    let line = scrape
        .lines()
        .find(|l| l.starts_with(&series))
        .unwrap_or_else(|| panic!("no {series} in\n{scrape}"));
    line[series.len()..].trim().parse().expect("a count")
}

/// In one process, `/metrics`' `rejected` is the report's: the
/// server's refusal of a request it found corrupted is counted once,
/// in the report's `corrupted` (the server's) and at `/metrics` as
/// `refused`; a garbled status is `rejected` in both. What the server
/// found (corrupted, duplicated, reordered, unmatched) is published
/// by the server's reactor into the same series, so each is the
/// report's field.
#[test]
fn one_process_metrics_rejected_is_the_reports() {
    let ok = flat(&make_body(0, 100, 3));
    let mut client = Counts::default();
    answer(&mut client, true, Status::Ok, &ok);
    answer(&mut client, true, Status::BadRequest, &[]);
    answer(&mut client, true, Status::UnknownVariable, &ok);
    client.unmatched_responses = 1;
    client.failed = 1;
    // The server saw the three requests (and a duplicate, a reordered
    // one and an unmatched response), refused the one it found
    // corrupted, and answered all.
    let server = Counts {
        messages: 5,
        answered: 5,
        corrupted: 1,
        duplicated: 1,
        out_of_order: 1,
        unmatched_responses: 2,
        ..Counts::default()
    };
    let t = Telemetry::new();
    SoakCells::new(&t).publish(client.published());
    SoakCells::new(&t).publish(server.server_share().published());
    let scrape = crate::metrics::render(&t).expect("a scrape");
    let mut report = client;
    report.add_server(&server);
    assert_metrics_are_the_report(&scrape, &report);
    assert_eq!(
        (report.messages, report.answered, report.corrupted),
        (3, 3, 1)
    );
    assert_eq!((report.rejected, report.refused), (1, 1));
    assert_eq!(
        (
            report.duplicated,
            report.out_of_order,
            report.unmatched_responses
        ),
        (1, 1, 3)
    );
    assert_eq!(report.failed, 1);
    assert!(!report.clean());
}

/// A `--listen` server publishes no soak series; beside its client it
/// publishes what it adds to the report (not the requests, which the
/// client counts).
#[test]
fn a_server_publishes_its_share_only_beside_its_client() {
    let lay = layout(&soak_args(&["--connections", "1"])).expect("a layout");
    let mut alone = SoakServer::new(&lay, "tcp");
    alone.counts = Counts {
        messages: 2,
        answered: 2,
        corrupted: 1,
        ..Counts::default()
    };
    alone.publish();
    let scrape = crate::metrics::render(&lay.telemetry).expect("a scrape");
    assert!(!scrape.contains("starwire_soak_"), "{scrape}");
    let mut beside = SoakServer::new(&lay, "tcp").beside_its_client(&lay.telemetry);
    beside.counts = alone.counts;
    beside.publish();
    let scrape = crate::metrics::render(&lay.telemetry).expect("a scrape");
    assert_metrics_are_the_report(
        &scrape,
        &Counts {
            corrupted: 1,
            ..Counts::default()
        },
    );
}

/// `soak` parsed with `flags` (also [`super::layout`]'s tests).
pub(super) fn soak_args(flags: &[&str]) -> SoakArgs {
    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        soak: SoakArgs,
    }
    <Cli as clap::Parser>::parse_from(std::iter::once("soak").chain(flags.iter().copied())).soak
}

/// Assert that every `starwire_soak_messages_total{outcome}` in
/// `scrape` is the report's field of the same name: `report` holds
/// what [`report`] puts in them (`sent` is its `messages`, `unmatched`
/// its `unmatched_responses`); `refused`, which the report has not,
/// is the client's count of it. So is
/// `starwire_soak_connections_failed_total` the report's
/// `connections_failed`.
fn assert_metrics_are_the_report(scrape: &str, report: &Counts) {
    let want = [
        ("sent", report.messages),
        ("answered", report.answered),
        ("lost", report.lost),
        ("duplicated", report.duplicated),
        ("corrupted", report.corrupted),
        ("rejected", report.rejected),
        ("refused", report.refused),
        ("unmatched", report.unmatched_responses),
        ("out_of_order", report.out_of_order),
    ];
    let got: Vec<(&str, u64)> = want.iter().map(|(o, _)| (*o, scraped(scrape, o))).collect();
    assert_eq!(got, want, "{scrape}");
    // No outcome is left out.
    let series = scrape
        .lines()
        .filter(|l| l.starts_with("starwire_soak_messages_total{"))
        .count();
    assert_eq!(series, want.len(), "{scrape}");
    let failed = scrape
        .lines()
        .find_map(|l| l.strip_prefix("starwire_soak_connections_failed_total "))
        .unwrap_or_else(|| panic!("no connections_failed series in\n{scrape}"));
    assert_eq!(
        failed.trim().parse::<u64>().expect("a count"),
        report.failed,
        "{scrape}"
    );
}

/// A whole soak in one process over tcp, the faults (`corrupt`) under
/// the server's links only: the server finds corrupted requests and
/// refuses them. Once it is over, `/metrics` is the report.
#[test]
fn one_process_soak_metrics_are_the_report() {
    let args = soak_args(&[
        "--connections",
        "8",
        "--client-reactors",
        "1",
        "--server-reactors",
        "1",
        "--duration",
        "0.3",
        "--drain",
        "2",
        "--max-size",
        "2048",
        "--polling",
        "off",
        "--faults",
        "corrupt=0.02,seed=5",
    ]);
    let spec = args.faults.expect("a fault spec");
    let lay = layout(&args).expect("a layout");
    let cfg = TcpConfig::default();
    let make = |_| Ok(Links::new(cfg.max_frame_len));
    // The clients' links inject nothing.
    let attacher = move |first: u64, step: u64| {
        let faults = if first >= SERVER_LINKS {
            spec
        } else {
            FaultSpec::default()
        };
        faulty_attacher(faults, cfg)(first, step)
    };
    let out = run_soak(&args, &lay, make, attacher).expect("the soak runs");
    let scrape = crate::metrics::render(&lay.telemetry).expect("a scrape");
    assert!(
        out.counts.corrupted > 0,
        "the server found no corruption\n{scrape}"
    );
    assert_metrics_are_the_report(&scrape, &out.counts);
    assert!(!out.counts.clean());
    // The throughput fields, as the report has them: positive, over
    // no more than the sending window and the drain (the span begins
    // at the first request, after the dials).
    let t = out.counts.throughput();
    let json = serde_json::to_value(t).expect("throughput JSON");
    for k in ["measured_s", "msgs_per_s", "gbps"] {
        let v = json[k]
            .as_f64()
            .unwrap_or_else(|| panic!("no {k} in {json}"));
        assert!(v > 0.0, "{k} {v}: {json}");
    }
    assert!(t.measured_s <= args.duration + args.drain, "{json}");
    assert_eq!(
        t.msgs_per_s,
        out.counts.answered as f64 / t.measured_s,
        "{json}"
    );
    // A round trip for every answered request, and at `/metrics` the
    // same percentiles as the report's.
    let l = out
        .round_trips
        .as_ref()
        .expect("the clients' round trips")
        .latency();
    assert!(l.count > 0, "{l:?}");
    assert_eq!(l.count, out.counts.answered, "{l:?}");
    assert!(
        l.p50 <= l.p99 && l.p99 <= l.p999 && l.p999 <= l.max,
        "{l:?}"
    );
    for (q, want) in [
        ("0.5", l.p50),
        ("0.99", l.p99),
        ("0.999", l.p999),
        ("1", l.max),
    ] {
        let series = format!("starwire_soak_latency_us{{quantile=\"{q}\"}} ");
        let got: f64 = scrape
            .lines()
            .find_map(|line| line.strip_prefix(&series))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("no {series} in\n{scrape}"));
        assert_eq!(got, want, "{scrape}");
    }
}

/// In one process the server's rejections of corrupted requests are
/// counted once (in `corrupted`), a garbled status on top of them in
/// `rejected`.
#[test]
fn one_process_counts_the_servers_rejections_once() {
    let client = Counts {
        messages: 10,
        answered: 10,
        rejected: 1,
        refused: 2,
        ..Counts::default()
    };
    let server = Counts {
        messages: 10,
        answered: 10,
        corrupted: 2,
        ..Counts::default()
    };
    let mut c = client;
    c.add_server(&server);
    assert_eq!(
        (c.messages, c.answered, c.corrupted, c.rejected),
        (10, 10, 2, 1)
    );
    // Refusals only, all the server's: counted as corrupted.
    let mut c = Counts {
        rejected: 0,
        ..client
    };
    c.add_server(&server);
    assert_eq!((c.corrupted, c.rejected), (2, 0));
    assert!(!c.clean());
}

#[test]
fn unmatched_responses_fail_the_soak() {
    let c = Counts {
        messages: 5,
        answered: 5,
        unmatched_responses: 1,
        ..Counts::default()
    };
    assert!(!c.clean());
    assert!(Counts {
        unmatched_responses: 0,
        ..c
    }
    .clean());
}
