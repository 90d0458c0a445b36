use super::*;

fn write_run(dir: &Path, lines: &[&str]) -> PathBuf {
    let path = dir.join("metrics.jsonl");
    std::fs::write(&path, lines.join("\n")).unwrap();
    path
}

/// An SFT-like run: a loss falling over 20 steps, validation every 5, step 10 logged twice (a resume).
fn sft_run(dir: &Path) -> PathBuf {
    let mut lines: Vec<String> = (1..=20)
        .map(|s| {
            format!(
                r#"{{"step": {s}, "train/loss": {}, "train/lr": 1e-5}}"#,
                3.0 / s as f64
            )
        })
        .collect();
    lines.push(r#"{"step": 10, "train/loss": 0.25, "train/lr": 1e-5}"#.into());
    lines.extend(
        (1..=4).map(|k| format!(r#"{{"step": {}, "val/loss": {}}}"#, 5 * k, 2.0 / k as f64)),
    );
    let refs: Vec<&str> = lines.iter().map(String::as_str).collect();
    write_run(dir, &refs)
}

#[test]
fn the_last_value_of_a_step_wins_and_bad_lines_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let series = read_metrics(&sft_run(dir.path())).unwrap();
    assert_eq!(series["train/loss"].len(), 20);
    assert_eq!(series["train/loss"][9], (10, 0.25));
    assert_eq!(
        series["val/loss"],
        vec![(5, 2.0), (10, 1.0), (15, 2.0 / 3.0), (20, 0.5)]
    );
    write_run(dir.path(), &[r#"{"step": 1, "x": 1}"#, r#"{"x": 2}"#]);
    let err = read_metrics(dir.path()).unwrap_err();
    assert!(
        format!("{err:#}").contains("metrics.jsonl line 2: no `step`"),
        "{err:#}"
    );
}

#[test]
fn a_png_shows_each_curve_in_its_colour_and_validation_points_beside_training() {
    let dir = tempfile::tempdir().unwrap();
    sft_run(dir.path());
    let out = dir.path().join("curves.png");
    plot(dir.path(), None, &out).unwrap();
    let img = image::open(&out).unwrap().to_rgb8();
    assert_eq!(
        img.dimensions(),
        (1200, 380),
        "two panels (loss, lr) in one row"
    );
    let count = |c: RGBAColor| {
        let (r, g, b) = (c.0, c.1, c.2);
        img.pixels().filter(|p| p.0 == [r, g, b]).count()
    };
    let white = img.pixels().filter(|p| p.0 == [255, 255, 255]).count();
    let ink = img.pixels().count() - white;
    assert!(ink > 20_000, "{ink} pixels drawn: a blank picture?");
    // In the `loss` panel, train/loss is the first series' colour, val/loss's points the second's.
    let train = count(Palette99::pick(0).to_rgba());
    let val = count(Palette99::pick(1).to_rgba());
    assert!(
        train > 300 && val > 100,
        "train/loss {train} px, val/loss {val} px"
    );
}

#[test]
fn an_svg_names_its_axes_and_legend_and_unknown_metrics_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    sft_run(dir.path());
    let out = dir.path().join("pics/loss.svg");
    let loss = ["train/loss".to_string(), "val/loss".to_string()];
    plot(dir.path(), Some(&loss), &out).unwrap();
    let svg = std::fs::read_to_string(&out).unwrap();
    let texts: Vec<&str> = svg
        .split("<text")
        .skip(1)
        .filter_map(|t| {
            t.split_once('>')
                .and_then(|(_, rest)| rest.split('<').next())
        })
        .map(str::trim)
        .collect();
    for text in ["step", "train/loss", "val/loss", "loss", "20"] {
        assert!(
            texts.contains(&text),
            "no text `{text}` in the SVG: {texts:?}"
        );
    }
    let err = plot(dir.path(), Some(&["val/acc".to_string()]), &out).unwrap_err();
    let msg = format!("{err:#}");
    assert!(
        msg.contains("no `val/acc`") && msg.contains("train/loss"),
        "{msg}"
    );
}
