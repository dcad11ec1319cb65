"""Tests of zeroshard/estimate/."""
